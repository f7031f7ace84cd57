"""Readable pure-PyTorch references, the executable specification the tests and benchmarks
compare the C core against: reference.py (the ops of the C core) and reference_dno.py (TitanMAC's
DeepNestedOptimizer). No module of titanmac_c's own code paths imports this package."""
