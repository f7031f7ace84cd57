"""Build titanmac_c._C: one C11 extension (plus CUDA objects when nvcc is there).

No torch at build time: tensors come in through DLPack. The C sources are every *.c under
csrc/{common,core,cpu,python}; the ISA files get their own flags; csrc/cuda/*.cu go through nvcc.
All objects compile concurrently, then one link (as llm.c's Makefile and apex's setup.py do): one
thread pool of os.cpu_count() compilers (TITANMAC_BUILD_JOBS overrides it) takes the longest
compiles first, so that none starts last and runs alone: the C files that hold every CPU loop
body (LOOP_FILES), then the CUDA files, the largest first (each nvcc compiles its archs one after
another), then the other C files. Where the machine has at least twice as many cores as
there are CUDA files, each nvcc also compiles its archs in parallel (nvcc --threads), and the pool
shrinks to match, so that no more compilers run at once than there are cores. It prints what it
compiles (the C files, each CUDA file with its archs, and how long each took).

Environment (defaults first):
  TITANMAC_WITH_CUDA   auto | 0 | 1   auto: CUDA when nvcc is found and csrc/cuda has .cu files;
                                      1: CUDA required (fail without nvcc)
  TITANMAC_CUDA_ARCHS  "75;80;86;89;90;100;103;120"  SASS for each ("90", "90a", "9.0"
                                             accepted), plus PTX of the lowest, which the
                                             driver compiles at load on any newer GPU; the
                                             default drops those nvcc cannot build
  TITANMAC_OPENMP      auto | 0 | 1   -fopenmp; auto: when the C compiler builds and links an
                                      OpenMP program (Apple's clang does not), else the CPU
                                      loops run on one thread; 1: OpenMP required
  TITANMAC_NATIVE      0 | 1          -march=native (never in a build meant for other machines)
  TITANMAC_WERROR      0 | 1          -Werror
  TITANMAC_SANITIZE    0 | 1          -fsanitize=address,undefined (load with libasan preloaded)
  TITANMAC_BUILD_JOBS  os.cpu_count()  compilers run at once
  CUDA_HOME / CUDA_PATH               where to look for nvcc and libcudart_static first
"""

import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
try:
    from setuptools.errors import CompileError, LinkError
except ImportError:  # setuptools < 59, reachable with --no-build-isolation
    from distutils.errors import CompileError, LinkError

C_DIRS = ["csrc/common", "csrc/core", "csrc/cpu", "csrc/python"]
INCLUDE_DIRS = ["csrc/include", "csrc/common", "csrc/cpu", "csrc/cuda", "csrc/core", "csrc/python"]
# -fno-trapping-math: we never enable FP traps, and without it GCC will not if-convert a float
# select (cond ? a : b) whose arm it sank into a branch, so a loop holding one stops vectorizing
# (the CMS exp's clamps, 14% of a CMS step). It changes no result: no reassociation.
# -ffp-contract=off: no a * b + c fused into an FMA, so every backend rounds as the scalar code
# reads (GCC's default under -std=c11; clang's default fuses within an expression).
C_FLAGS = ["-std=c11", "-O3", "-Wall", "-Wextra", "-fvisibility=hidden", "-fno-math-errno",
           "-fno-trapping-math", "-ffp-contract=off"]
NVCC_FLAGS = ["-std=c++17", "-O3", "-lineinfo", "-Xcompiler", "-fPIC",
              "-Xcompiler", "-fvisibility=hidden"]
# Turing to Blackwell: T4, A100, RTX 30, L4/RTX 40, H100/H200, B200/GB200, B300/GB300, RTX 50.
# PTX of the lowest runs on every GPU newer than all of them (compute_120's could not be compiled
# for sm_100, so before sm_100 was listed a B200 had no code to run).
DEFAULT_ARCHS = "75;80;86;89;90;100;103;120"
IS_X86_64 = platform.machine().lower() in ("x86_64", "amd64")
ISA_FLAGS = {
    "csrc/cpu/cpu_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "csrc/cpu/cpu_avx512.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"],
} if IS_X86_64 else {}
# The C files that compile every CPU loop body (one instruction set each): the longest C compiles,
# started first.
LOOP_FILES = ("csrc/cpu/cpu_generic.c", "csrc/cpu/cpu_avx2.c", "csrc/cpu/cpu_avx512.c")


def env_on(name, default):
    value = os.environ.get(name, default).strip().lower()
    if value not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise SystemExit(f"titanmac_c: {name}={value!r}: expected 0 or 1")
    return value in ("1", "true", "yes", "on")


def env_mode(name):
    """An auto | 0 | 1 setting (default auto)."""
    value = os.environ.get(name, "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise SystemExit(f"titanmac_c: {name}={value!r}: expected auto, 0 or 1")
    return value


def c_sources():
    return [p for d in C_DIRS for p in sorted(glob.glob(os.path.join(d, "*.c")))]


def find_cuda():
    """(nvcc, directory holding libcudart_static.a), or (None, None)."""
    homes = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    candidates = [(os.path.join(h, "bin", "nvcc"), h) for h in homes if h]
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append((on_path, os.path.dirname(os.path.dirname(os.path.realpath(on_path)))))
    for nvcc, home in candidates:
        if os.path.isfile(nvcc) and os.access(nvcc, os.X_OK):
            target = "sbsa-linux" if platform.machine() == "aarch64" else "x86_64-linux"
            for lib in (os.path.join(home, "lib64"), os.path.join(home, "targets", target, "lib"),
                        os.path.join(home, "lib"), "/usr/local/cuda/lib64"):
                if os.path.isfile(os.path.join(lib, "libcudart_static.a")):
                    return nvcc, lib
            return nvcc, None
    return None, None


def openmp_missing(compiler, build_temp):
    """None when the C compiler builds and links a program with -fopenmp, else why not."""
    probe_dir = os.path.join(build_temp, "openmp_probe")
    os.makedirs(probe_dir, exist_ok=True)
    src = os.path.join(probe_dir, "probe.c")
    with open(src, "w") as f:
        f.write("#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
    try:
        objects = compiler.compile([src], output_dir=probe_dir, extra_postargs=["-fopenmp"])
        compiler.link_executable(objects, "probe", output_dir=probe_dir,
                                 extra_postargs=["-fopenmp"])
    except (CompileError, LinkError):
        return f"{compiler.compiler_so[0]} cannot build and link with -fopenmp"
    return None


def default_archs(nvcc):
    """DEFAULT_ARCHS less those this nvcc cannot build (CUDA 13 has no sm_70, 12.0 no sm_120)."""
    try:
        out = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return DEFAULT_ARCHS
    known = set(re.findall(r"sm_(\w+)", out.stdout))
    return ";".join(a for a in DEFAULT_ARCHS.split(";") if a in known) or DEFAULT_ARCHS


def build_jobs():
    """Compilers to run at once: TITANMAC_BUILD_JOBS, else the CPU count."""
    value = os.environ.get("TITANMAC_BUILD_JOBS", "").strip()
    if not value:
        return os.cpu_count() or 1
    if not value.isdigit() or int(value) < 1:
        raise SystemExit(f"titanmac_c: TITANMAC_BUILD_JOBS={value!r}: expected a count >= 1")
    return int(value)


_print_lock = threading.Lock()


def say(text):
    """One whole line on stdout, also from the pool's threads."""
    with _print_lock:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def arch_names(gencode):
    """The -gencode flags as 'sm_75, sm_80, ... + PTX compute_75'."""
    codes = [flag.split("code=")[1] for flag in gencode if "code=" in flag]
    sass = [c for c in codes if c.startswith("sm_")]
    ptx = [c for c in codes if c.startswith("compute_")]
    return ", ".join(sass) + (" + PTX " + ", ".join(ptx) if ptx else "")


def gencode_flags(archs):
    """"90;90a;120" -> -gencode SASS for each entry, plus PTX of the lowest: the driver compiles
    it at load on a GPU none of the SASS runs on. The PTX is the plain arch's (compute_90 for
    90a): an arch-specific one would run on its own arch only, and no kernel here needs one."""
    flags, numbers = [], []
    for entry in re.split(r"[;,\s]+", archs.strip()):
        arch = entry.replace(".", "")
        if not arch:
            continue
        if not re.fullmatch(r"\d+[af]?", arch):
            raise SystemExit(f"titanmac_c: TITANMAC_CUDA_ARCHS entry {entry!r}: "
                             "expected e.g. 90 or 90a")
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        numbers.append(int(re.match(r"\d+", arch).group()))
    if not numbers:
        raise SystemExit("titanmac_c: TITANMAC_CUDA_ARCHS is empty")
    lowest = min(numbers)
    return flags + ["-gencode", f"arch=compute_{lowest},code=compute_{lowest}"]


class BuildExt(build_ext):
    """Compiles every object of the extension in a thread pool (the C loop files, CUDA with nvcc
    largest first, the other C files; C with per-file ISA flags), skipping objects whose source,
    headers and command are unchanged, then links."""

    def build_extension(self, ext):
        cuda_mode = env_mode("TITANMAC_WITH_CUDA")
        cu_files = sorted(glob.glob("csrc/cuda/*.cu"))
        nvcc, cuda_lib = find_cuda() if cuda_mode != "0" else (None, None)
        missing = ("TITANMAC_WITH_CUDA=0" if cuda_mode == "0" else
                   "nvcc was not found (set CUDA_HOME)" if nvcc is None else
                   f"libcudart_static.a was not found next to {nvcc}" if cuda_lib is None else
                   "csrc/cuda has no .cu files" if not cu_files else None)
        if cuda_mode == "1" and missing:
            raise SystemExit(f"titanmac_c: TITANMAC_WITH_CUDA=1 but {missing}")
        with_cuda = missing is None

        cflags = list(C_FLAGS)
        ldflags, libraries, library_dirs = [], [], []
        openmp_mode = env_mode("TITANMAC_OPENMP")
        no_openmp = ("TITANMAC_OPENMP=0" if openmp_mode == "0" else
                     openmp_missing(self.compiler, self.build_temp))
        if openmp_mode == "1" and no_openmp:
            raise SystemExit(f"titanmac_c: TITANMAC_OPENMP=1 but {no_openmp}")
        if not no_openmp:
            cflags.append("-fopenmp")
            ldflags.append("-fopenmp")
        if env_on("TITANMAC_NATIVE", "0"):
            cflags.append("-march=native")
        if env_on("TITANMAC_WERROR", "0"):
            cflags.append("-Werror")
        if env_on("TITANMAC_SANITIZE", "0"):
            san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
            cflags += san
            ldflags += san
        macros = [("TM_WITH_CUDA", "1")] if with_cuda else []
        if with_cuda:
            libraries += ["cudart_static", "rt", "pthread", "dl", "stdc++"]
            library_dirs.append(cuda_lib)
            ldflags.append("-Wl,--exclude-libs,ALL")  # keep cudart's symbols out of our exports

        archs = os.environ.get("TITANMAC_CUDA_ARCHS") or (default_archs(nvcc) if with_cuda else "")
        print("titanmac_c: building backends: cpu ({}{}){}".format(
            "generic" + (", avx2, avx512" if IS_X86_64 else ""),
            f", no OpenMP: {no_openmp}, one thread" if no_openmp else ", openmp",
            f" + cuda (archs {archs}, {nvcc})" if with_cuda else f" only (no CUDA: {missing})"),
            flush=True)

        cpus = build_jobs()
        c_first = [src for src in ext.sources if src in LOOP_FILES]
        c_rest = [src for src in ext.sources if src not in LOOP_FILES]
        jobs = [self._c_job(ext, src, cflags + ISA_FLAGS.get(src, []), macros) for src in c_first]
        workers = cpus
        if with_cuda:
            # the longest compiles first: a long nvcc started last would run alone at the end
            cu_files.sort(key=os.path.getsize, reverse=True)
            gencode = gencode_flags(archs)
            n_archs = sum(1 for flag in gencode if "code=" in flag)
            # spare cores: each nvcc compiles archs in parallel, the pool shrinks to match
            # (nvcc jobs * threads + the other workers never exceed cpus)
            threads = max(1, min(n_archs, cpus // len(cu_files)))
            workers = max(1, cpus - len(cu_files) * (threads - 1))
            incs = [f"-I{d}" for d in ext.include_dirs]
            nvflags = (NVCC_FLAGS + ["-DTM_WITH_CUDA=1"] + incs + gencode
                       + (["--threads", str(threads)] if threads > 1 else []))
            say(f"titanmac_c: {len(cu_files)} CUDA files ({', '.join(cu_files)}) for "
                f"{arch_names(gencode)}"
                + (f", {threads} archs at once per file" if threads > 1 else ""))
            jobs += [self._nvcc_job(nvcc, src, nvflags) for src in cu_files]
        say(f"titanmac_c: {len(ext.sources)} C files ({', '.join(ext.sources)}); "
            f"{workers} compilers at once")
        jobs += [self._c_job(ext, src, cflags + ISA_FLAGS.get(src, []), macros) for src in c_rest]
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            built = set(pool.map(lambda job: job(), jobs))
        # linked in a fixed order: the C objects by path (as listed), then the CUDA ones
        objects = sorted(built, key=lambda obj: (obj.endswith(".cu.o"), obj))
        say(f"titanmac_c: compiled in {time.perf_counter() - start:.0f} s; linking")

        target = self.get_ext_fullpath(ext.name)
        # an extension of an earlier build under another name (_C.cpython-311-*.so before the
        # Limited API) would be installed beside this one and imported first: Python tries the
        # version-tagged name before .abi3.so
        stem = os.path.join(os.path.dirname(target), ext.name.split(".")[-1])
        for stale in glob.glob(stem + ".*.so") + glob.glob(stem + ".*.pyd"):
            if os.path.abspath(stale) != os.path.abspath(target):
                say(f"titanmac_c: removing {stale}, an earlier build's")
                os.remove(stale)
        self.compiler.link_shared_object(
            objects, target, libraries=libraries,
            library_dirs=library_dirs, extra_postargs=ldflags,
            export_symbols=self.get_export_symbols(ext), build_temp=self.build_temp,
            target_lang="c")

    # -- one object per source; each job returns the object path ------------------------------

    def _object(self, src, suffix):
        obj = os.path.join(self.build_temp, os.path.splitext(src)[0] + suffix)
        os.makedirs(os.path.dirname(obj), exist_ok=True)
        return obj

    def _fresh(self, src, obj, command):
        """True when obj was built by the same command after src and every header changed."""
        stamp = obj + ".cmd"
        if self.force or not os.path.exists(obj) or not os.path.exists(stamp):
            return False
        with open(stamp) as f:
            if f.read() != json.dumps(command):
                return False
        headers = [h for pattern in ("csrc/**/*.h", "csrc/**/*.cuh")
                   for h in glob.glob(pattern, recursive=True)]
        newest = max(os.path.getmtime(p) for p in [src] + headers)
        return os.path.getmtime(obj) >= newest

    def _c_job(self, ext, src, flags, macros):
        obj = self._object(src, ".o")
        key = [self.compiler.compiler_so, flags, macros, ext.include_dirs]

        def run():
            if not self._fresh(src, obj, key):
                built = self.compiler.compile([src], output_dir=self.build_temp, macros=macros,
                                              include_dirs=ext.include_dirs, extra_postargs=flags)
                assert os.path.abspath(built[0]) == os.path.abspath(obj), (built, obj)
                with open(obj + ".cmd", "w") as f:
                    f.write(json.dumps(key))
            return obj
        return run

    def _nvcc_job(self, nvcc, src, flags):
        obj = self._object(src, ".cu.o")
        command = [nvcc, "-c", src, "-o", obj] + flags

        def run():
            if self._fresh(src, obj, command):
                say(f"titanmac_c: {src} is up to date")
                return obj
            say(" ".join(command))
            start = time.perf_counter()
            subprocess.run(command, check=True)
            say(f"titanmac_c: nvcc {src} done in {time.perf_counter() - start:.1f} s")
            with open(obj + ".cmd", "w") as f:
                f.write(json.dumps(command))
            return obj
        return run


# The Limited API of Python 3.10 (Py_LIMITED_API, set in csrc/python/py_module.h): one build,
# named _C.abi3.so, loads in every CPython >= 3.10, and its wheel is tagged cp310-abi3.
setup(
    ext_modules=[Extension("titanmac_c._C", sources=c_sources(), include_dirs=INCLUDE_DIRS,
                           language="c", py_limited_api=True)],
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
