"""YAML injection rules: parse, match, apply through the operator registry."""
