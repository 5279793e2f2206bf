"""Benchmark harness behind `hetmoe bench`."""
