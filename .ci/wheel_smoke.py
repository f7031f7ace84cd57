"""The installed wheel's extension in this interpreter, without torch: loaded by itself (the
package's __init__ imports torch, which is not installed here) and three AdamW steps taken on
numpy arrays through DLPack, each element checked against the same steps in float64 numpy.
CI runs it with every CPython >= 3.10 the machine has, to show that the one cp310-abi3 build
loads and computes in all of them.

Usage: python .ci/wheel_smoke.py   (in an environment with numpy and the wheel installed)
"""

import importlib.machinery
import importlib.util
import os
import sys

import numpy as np


def load_extension():
    package = importlib.util.find_spec("titanmac_c")  # finds the folder, runs nothing
    folder = package.submodule_search_locations[0]
    (name,) = [n for n in os.listdir(folder) if n.startswith("_C.") and n.endswith(".so")]
    assert name == "_C.abi3.so", name
    path = os.path.join(folder, name)
    loader = importlib.machinery.ExtensionFileLoader("titanmac_c._C", path)
    spec = importlib.util.spec_from_file_location("titanmac_c._C", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module, path


def main():
    _C, path = load_extension()
    rng = np.random.default_rng(0)
    sizes = [1, 255, 4097, 70001]
    beta1, beta2, eps, wd, lr = 0.9, 0.999, 1e-8, 0.01, 1e-3
    params = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    exp_avgs = [np.zeros(n, np.float32) for n in sizes]
    exp_avg_sqs = [np.zeros(n, np.float32) for n in sizes]
    steps = [np.zeros(1, np.float32) for _ in sizes]
    want = [p.astype(np.float64) for p in params]
    m = [np.zeros(n) for n in sizes]
    v = [np.zeros(n) for n in sizes]
    for t in range(1, 4):
        grads = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        _C.adamw_step(params, grads, exp_avgs, exp_avg_sqs, [], steps,
                      np.full(1, lr, np.float32), [(beta1, beta2, eps, wd, False)],
                      num_threads=2)
        for i, g in enumerate(grads):
            g = g.astype(np.float64)
            want[i] *= 1 - lr * wd
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            denom = np.sqrt(v[i]) / np.sqrt(1 - beta2**t) + eps
            want[i] -= lr / (1 - beta1**t) * m[i] / denom
        for i in range(len(sizes)):
            assert steps[i][0] == t, (i, steps[i])
            np.testing.assert_allclose(params[i], want[i], rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(exp_avgs[i], m[i], rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(exp_avg_sqs[i], v[i], rtol=1e-6, atol=1e-9)
    print(f"wheel smoke: Python {sys.version.split()[0]}, numpy {np.__version__}: {path} "
          f"(CPU loop {_C.cpu_isa()}, CUDA compiled {_C.cuda_compiled()}): "
          f"3 AdamW steps on {len(sizes)} tensors match float64 numpy")


if __name__ == "__main__":
    main()
