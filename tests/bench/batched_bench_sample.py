"""A canned llama-batched-bench stdout (the peer kit's llama.cpp, tools/batched-bench/
batched-bench.cpp: its log line, then the markdown table its printf writes), shared by
test_batched_bench.py and test_serve_report.py."""

MARKDOWN = """
main: n_kv_max = 20480, n_batch = 4096, n_ubatch = 4096, flash_attn = -1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = 99, n_threads = 15, n_threads_batch = 15

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |     48 |    1 |     80 |    0.131 |   244.27 |    1.702 |    28.20 |    1.833 |    43.64 |
|    32 |     48 |    2 |    160 |    0.178 |   359.55 |    2.604 |    36.87 |    2.782 |    57.51 |
|    32 |     48 |    4 |    320 |    0.262 |   488.55 |    3.915 |    49.04 |    4.177 |    76.61 |
|    32 |     48 |    8 |    640 |    0.401 |   638.40 |    5.221 |    73.55 |    5.622 |   113.84 |
|    32 |     48 |   16 |   1280 |    0.655 |   781.68 |    7.483 |   102.63 |    8.138 |   157.29 |
|    32 |     48 |   32 |   2560 |    1.109 |   923.35 |   10.377 |   148.02 |   11.486 |   222.88 |
|    32 |     48 |   64 |   5120 |    1.843 |  1111.23 |   14.266 |   215.34 |   16.109 |   317.83 |
|    32 |     48 |  128 |  10240 |    3.297 |  1242.34 |   21.843 |   281.28 |   25.140 |   407.32 |
|    32 |     48 |  256 |  20480 |    6.112 |  1340.31 |   34.911 |   351.98 |   41.023 |   499.23 |

"""
"""A `-npp 32 -ntg 48 -npl 1,2,...,256` run's stdout, columns as its printf writes them."""
