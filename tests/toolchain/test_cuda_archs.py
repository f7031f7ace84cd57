"""The GPU code the built extension carries: machine code (SASS) for every arch the build was asked
for, plus PTX of the lowest, which the driver compiles at load on a GPU newer than all of them.

The code is read from the extension itself, without cuobjdump (CUDA's runtime toolkit leaves it
out): the ELF section `.nv_fatbin` of `titanmac_c._C` holds one fat binary container per CUDA
source file, each a 16-byte header followed by its entries, an entry being a header, then its
payload (a cubin ELF or PTX text, either possibly compressed):

    container header (16 bytes, little-endian)
      0  u32  magic 0xBA55ED50
      4  u16  version (1)
      6  u16  header size (16): the first entry follows at this offset
      8  u64  bytes of the entries that follow
    entry header (64 bytes, or more: its own size is in it)
      0  u16  kind: 1 PTX, 2 ELF cubin
      4  u32  header size: the payload follows at this offset
      8  u64  payload size (8-byte aligned)
     16  u32  compressed size (0: stored as is)
     24  u16  minor, 26 u16 major: the code's version (PTX ISA, cubin ABI)
     28  u32  arch: 75 for sm_75 / compute_75
     32  u32  offset of the source file's name within the header, 36 u32 its length
     40  u64  flags: 0x100000 arch-specific (sm_90a), 0x200000 family (sm_100f)

Checked against builds of this extension and of a one-kernel file with nvcc 13.0: the entries are
exactly the -gencode flags passed, and each cubin's own ELF header (e_flags) names the arch its
entry does (test_embedded_code_matches_the_build cross-checks every uncompressed cubin so).

Which archs to expect: TITANMAC_CUDA_ARCHS where it is set (the build reads the same variable);
else, where TITANMAC_EXPECT_CUDA=1 (CI and the GPU script, which build without it), setup.py's
default list less the archs this machine's nvcc cannot build, as setup.py's default_archs()
drops them; else only what holds for any build (one PTX, of the lowest SASS arch; every source
file compiled for the same archs). A CPU-only build has no `.nv_fatbin`: that fails where
TITANMAC_EXPECT_CUDA=1 and is skipped elsewhere. The parser itself is tested on a fat binary built
here, on every machine.
"""

import ast
import os
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass

import pytest

from titanmac_c import _C
from conftest import ROOT

FATBIN_MAGIC = 0xBA55ED50
FATBIN_SECTION = ".nv_fatbin"
KIND_PTX, KIND_ELF = 1, 2
FLAG_ARCH_SPECIFIC, FLAG_FAMILY = 0x100000, 0x200000
EM_CUDA = 190
# the generation of each default arch, as the README names the lowest and the highest
GENERATION = {75: "Turing", 80: "Ampere", 86: "Ampere", 89: "Ada", 90: "Hopper",
              100: "Blackwell", 103: "Blackwell", 110: "Blackwell", 120: "Blackwell",
              121: "Blackwell"}


class FatbinError(ValueError):
    pass


@dataclass(frozen=True)
class Entry:
    kind: int           # KIND_PTX or KIND_ELF
    arch: int           # 90 for sm_90, sm_90a and compute_90
    suffix: str         # "", "a" (arch-specific) or "f" (family)
    source: str         # the .cu file it was compiled from ("" where the entry names none)
    compressed: bool
    cubin_arch: int     # the arch the cubin's own ELF header names; 0: PTX, or compressed

    @property
    def name(self):
        return f"{'sm' if self.kind == KIND_ELF else 'compute'}_{self.arch}{self.suffix}"


def elf_sections(data):
    """{name: (offset, size)} of a 64-bit little-endian ELF file's sections."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise FatbinError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff + shnum * shentsize > len(data) or shstrndx >= shnum:
        raise FatbinError("section headers past the end of the file")
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    sections = {}
    for name_off, _type, _flags, _addr, offset, size in headers:
        start = names_at + name_off
        name = data[start:data.index(b"\0", start)].decode()
        sections[name] = (offset, size)
    return sections


def cubin_arch(elf):
    """The SM a cubin is for, from its ELF header: e_flags bits 8-15 from ELF ABI version 8 on
    (nvcc 13), bits 0-7 before."""
    if elf[:4] != b"\x7fELF" or struct.unpack_from("<H", elf, 18)[0] != EM_CUDA:
        raise FatbinError("an ELF entry whose payload is not a CUDA ELF file")
    flags, = struct.unpack_from("<I", elf, 48)
    return (flags >> 8) & 0xFF if elf[8] >= 8 else flags & 0xFF


def fatbin_containers(blob):
    """The containers of a .nv_fatbin section, each a list of Entry. Containers follow one
    another; zero bytes up to an 8-byte boundary between them are padding."""
    containers, pos = [], 0
    while pos < len(blob):
        if blob[pos:pos + 8] == bytes(8) and pos % 8 == 0:
            pos += 8  # padding between containers
            continue
        if len(blob) - pos < 16:
            raise FatbinError(f"{len(blob) - pos} stray bytes at {pos}")
        magic, _version, header, size = struct.unpack_from("<IHHQ", blob, pos)
        if magic != FATBIN_MAGIC:
            raise FatbinError(f"magic {magic:#x} at {pos}, not {FATBIN_MAGIC:#x}")
        end = pos + header + size
        if end > len(blob):
            raise FatbinError(f"the container at {pos} ends past the section ({end} > {len(blob)})")
        containers.append(container_entries(blob, pos + header, end))
        pos = end
    return containers


def container_entries(blob, pos, end):
    entries = []
    while pos < end:
        if end - pos < 64:
            raise FatbinError(f"a truncated entry header at {pos}")
        kind, _version, header, payload = struct.unpack_from("<HHIQ", blob, pos)
        compressed_size, = struct.unpack_from("<I", blob, pos + 16)
        arch, name_off, name_len, flags = struct.unpack_from("<IIIQ", blob, pos + 28)
        if header < 64 or pos + header + payload > end:
            raise FatbinError(f"the entry at {pos} runs past its container")
        if kind not in (KIND_PTX, KIND_ELF):
            raise FatbinError(f"entry kind {kind} at {pos}: neither PTX (1) nor ELF (2)")
        source = ""
        if name_len and name_off + name_len <= header:
            source = blob[pos + name_off:pos + name_off + name_len].decode()
        data = blob[pos + header:pos + header + payload]
        plain_cubin = kind == KIND_ELF and data[:4] == b"\x7fELF"
        entries.append(Entry(
            kind=kind, arch=arch,
            suffix="a" if flags & FLAG_ARCH_SPECIFIC else "f" if flags & FLAG_FAMILY else "",
            source=source, compressed=compressed_size != 0,
            cubin_arch=cubin_arch(data) if plain_cubin else 0))
        pos += header + payload
    return entries


def embedded_code(path):
    """The fat binary containers of a shared library, or None when it has no .nv_fatbin."""
    with open(path, "rb") as f:
        data = f.read()
    section = elf_sections(data).get(FATBIN_SECTION)
    if section is None:
        return None
    offset, size = section
    return fatbin_containers(data[offset:offset + size])


def arch_entries(archs):
    """setup.py's reading of TITANMAC_CUDA_ARCHS: "90;90a;120" -> (["sm_90", "sm_90a",
    "sm_120"], "compute_90"), SASS for each and PTX of the lowest number."""
    entries = [e.replace(".", "") for e in re.split(r"[;,\s]+", archs.strip()) if e]
    lowest = min(int(re.match(r"\d+", e).group()) for e in entries)
    return sorted(f"sm_{e}" for e in entries), f"compute_{lowest}"


def setup_default_archs():
    """DEFAULT_ARCHS as setup.py assigns it (read from its source: importing setup.py builds)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DEFAULT_ARCHS"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py assigns no DEFAULT_ARCHS")


def find_nvcc():
    """The nvcc setup.py would use: under CUDA_HOME, CUDA_PATH, /usr/local/cuda, then PATH."""
    homes = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    for home in filter(None, homes):
        nvcc = os.path.join(home, "bin", "nvcc")
        if os.path.isfile(nvcc) and os.access(nvcc, os.X_OK):
            return nvcc
    return shutil.which("nvcc")


def expected_default_archs():
    """The default list less the archs this nvcc does not list (`nvcc --list-gpu-code`)."""
    nvcc = find_nvcc()
    assert nvcc, ("TITANMAC_EXPECT_CUDA=1 and the extension was built with the default archs, "
                  "but no nvcc is here to tell which of them it can build")
    listed = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True,
                            check=True).stdout
    known = set(re.findall(r"sm_(\w+)", listed))
    return ";".join(a for a in setup_default_archs().split(";") if a in known)


# ------------------------------------------------------------------ the parser, on built blobs

def _entry(kind, arch, payload, source=b"", flags=0x11, compressed=False, extra=0):
    """An entry as nvcc writes one: header (64 bytes + extra, the source's name after the 64),
    then the payload padded to 8 bytes."""
    header = 64 + extra + len(source)
    header += -header % 8
    padded = payload + bytes(-len(payload) % 8)
    minor, major = (8, 1) if kind == KIND_ELF else (0, 9)  # cubin ABI 1.8, PTX ISA 9.0
    head = struct.pack("<HHIQIIHHIIIQQQ", kind, 0x101, header, len(padded),
                       len(payload) if compressed else 0, 0, minor, major, arch,
                       64 + extra if source else 0, len(source), flags, 0,
                       4 * len(payload) if compressed else 0)
    head += bytes(extra) + source
    return head + bytes(header - len(head)) + padded


def _container(*entries):
    body = b"".join(entries)
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def _cubin(sm, abi):
    """The first 64 bytes of a cubin ELF header: class 64, little-endian, EM_CUDA, e_flags."""
    ident = b"\x7fELF" + bytes([2, 1, 1, 0x41, abi]) + bytes(7)
    flags = (0xA000000 | sm << 8 | 0x04) if abi >= 8 else (0x500000 | sm)
    return ident + struct.pack("<HHIQQQIHHHHHH", 2, EM_CUDA, 1, 0, 0, 0, flags, 64, 0, 0, 64,
                               0, 0)


def _shared_library(sections):
    """A minimal 64-bit ELF file holding the given {name: bytes} sections."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in (*sections, ".shstrtab"))
    blobs = [*sections.values(), names]
    offset, placed = 64, []
    for blob in blobs:
        placed.append(offset)
        offset += len(blob) + (-len(blob) % 8)
    shoff = offset
    body = b"".join(b + bytes(-len(b) % 8) for b in blobs)
    headers = bytes(64)  # section 0: SHT_NULL
    name_at = 1
    for i, name in enumerate((*sections, ".shstrtab")):
        headers += struct.pack("<IIQQQQIIQQ", name_at, 1 if i < len(sections) else 3, 0, 0,
                               placed[i], len(blobs[i]), 0, 0, 8, 0)
        name_at += len(name) + 1
    count = len(sections) + 2
    ehdr = (b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
            + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, count,
                          count - 1))
    return ehdr + body + headers


def test_the_parser_reads_every_entry_of_a_built_fatbin(tmp_path):
    """Two containers as two .cu files give them (the second after 8 bytes of padding): PTX
    (compressed) and cubins of both ELF ABIs, headers of 64 to 136 bytes, an arch-specific and a
    family entry; each entry's kind, arch, source file and compression, and each plain cubin's
    own arch, come back."""
    first = _container(
        _entry(KIND_PTX, 75, b"\x28\xb5\x2f\xfd" + bytes(29), b"csrc/cuda/a.cu", 0x8011, True,
               extra=24),
        _entry(KIND_ELF, 75, _cubin(75, 8) + bytes(100), b"csrc/cuda/a.cu"),
        _entry(KIND_ELF, 90, _cubin(90, 7) + bytes(3), b"csrc/cuda/a.cu"),
        _entry(KIND_ELF, 120, _cubin(120, 8), b"csrc/cuda/a.cu", 0x1000011, extra=48))
    second = _container(
        _entry(KIND_ELF, 90, _cubin(90, 8), flags=0x100011),
        _entry(KIND_ELF, 100, _cubin(100, 8), flags=0x1200011, extra=48),
        _entry(KIND_PTX, 90, b".version 9.0\n.target sm_90\n", flags=0x11))
    path = tmp_path / "lib.so"
    path.write_bytes(_shared_library({".text": b"\x90" * 40,
                                      FATBIN_SECTION: first + bytes(8) + second}))
    a, b = embedded_code(path)
    assert [(e.name, e.source, e.compressed, e.cubin_arch) for e in a] == [
        ("compute_75", "csrc/cuda/a.cu", True, 0),
        ("sm_75", "csrc/cuda/a.cu", False, 75),
        ("sm_90", "csrc/cuda/a.cu", False, 90),
        ("sm_120", "csrc/cuda/a.cu", False, 120)]
    assert [(e.name, e.source, e.cubin_arch) for e in b] == [
        ("sm_90a", "", 90), ("sm_100f", "", 100), ("compute_90", "", 0)]


def test_a_library_without_fatbin_has_no_embedded_code(tmp_path):
    path = tmp_path / "cpu.so"
    path.write_bytes(_shared_library({".text": b"\x90" * 8}))
    assert embedded_code(path) is None


@pytest.mark.parametrize("damage, match", [
    (lambda blob: b"\x51" + blob[1:], "magic"),
    (lambda blob: blob[:-8], "ends past the section"),
    (lambda blob: blob[:8] + struct.pack("<Q", 40) + blob[16:56], "truncated entry header"),
    (lambda blob: blob[:16] + struct.pack("<H", 7) + blob[18:], "entry kind 7"),
    (lambda blob: blob + b"\x01\x02", "stray bytes"),
])
def test_the_parser_refuses_a_damaged_fatbin(damage, match):
    blob = _container(_entry(KIND_ELF, 80, _cubin(80, 8)))
    assert [e.name for e in fatbin_containers(blob)[0]] == ["sm_80"]
    with pytest.raises(FatbinError, match=match):
        fatbin_containers(damage(blob))


def test_a_cubin_naming_another_arch_is_caught():
    wrong = _container(_entry(KIND_ELF, 86, _cubin(80, 8)))
    (entry,), = fatbin_containers(wrong)
    assert entry.arch == 86 and entry.cubin_arch == 80


def test_the_default_drops_what_nvcc_cannot_build(tmp_path, monkeypatch):
    """An nvcc that lists no sm_100/sm_103 (CUDA before 12.8/12.9): the default expected of a
    build made with it leaves them out, as setup.py's default_archs() does."""
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\nprintf 'sm_75\\nsm_80\\nsm_86\\nsm_87\\nsm_89\\nsm_90\\n"
                    "sm_120\\n'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert expected_default_archs() == "75;80;86;89;90;120"
    assert arch_entries(expected_default_archs()) == (
        ["sm_120", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90"], "compute_75")


# ------------------------------------------------------------------ the built extension

def test_embedded_code_matches_the_build():
    expect_cuda = os.environ.get("TITANMAC_EXPECT_CUDA") == "1"
    containers = embedded_code(_C.__file__)
    if containers is None:
        assert not expect_cuda, (f"TITANMAC_EXPECT_CUDA=1 but {_C.__file__} has no "
                                 f"{FATBIN_SECTION} section: a build without CUDA")
        assert not _C.cuda_compiled()
        pytest.skip("a CPU-only build: no GPU code to check")
    assert _C.cuda_compiled()
    cu_files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cuda").glob("*.cu"))
    assert sorted(c[0].source for c in containers) == cu_files, "one container per .cu file"
    sass = sorted(e.name for e in containers[0] if e.kind == KIND_ELF)
    ptx = [e.name for e in containers[0] if e.kind == KIND_PTX]
    for entries in containers:
        where = entries[0].source
        assert sorted(e.name for e in entries if e.kind == KIND_ELF) == sass, where
        assert [e.name for e in entries if e.kind == KIND_PTX] == ptx, where
        assert {e.source for e in entries} == {where}
        for e in entries:
            if e.kind == KIND_ELF and not e.compressed:
                assert e.cubin_arch == e.arch, f"{where}: {e.name} holds a cubin for sm_" \
                                               f"{e.cubin_arch}"
    lowest = min(int(re.match(r"sm_(\d+)", s).group(1)) for s in sass)
    assert ptx == [f"compute_{lowest}"], "PTX of the lowest arch, and only that"
    archs = os.environ.get("TITANMAC_CUDA_ARCHS")
    if archs:
        assert (sass, ptx[0]) == arch_entries(archs), f"TITANMAC_CUDA_ARCHS={archs}"
    elif expect_cuda:
        default = expected_default_archs()
        assert (sass, ptx[0]) == arch_entries(default), (
            f"the default archs here are {default}; a build for others runs its tests with "
            "TITANMAC_CUDA_ARCHS set as it was")


def test_the_readme_names_the_default_archs():
    """The build option line lists setup.py's DEFAULT_ARCHS, and the platform sentence names the
    lowest and the highest with their generations."""
    default = setup_default_archs()
    numbers = [int(a) for a in default.split(";")]
    text = " ".join((ROOT / "README.md").read_text().split())
    assert f'`TITANMAC_CUDA_ARCHS="{default}"`' in text
    lo, hi = min(numbers), max(numbers)
    assert (f"NVIDIA GPUs from {GENERATION[lo]} (sm_{lo}) to {GENERATION[hi]} (sm_{hi}), newer "
            "ones through embedded PTX") in text
    assert {"100", "103"} <= set(default.split(";")), "B200/B300 SASS (no PTX reaches them)"
