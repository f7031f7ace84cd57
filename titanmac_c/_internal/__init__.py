"""The layer under the public modules: how Python meets the C core (argument conversion, layouts,
scratch buffers, error renaming, version bumps), the norm and scale calls, DTensor handling,
profiling ranges and the gradient marks. Nothing here imports from titanmac_c.functional, optim,
deep_nested or testing."""
