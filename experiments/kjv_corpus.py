"""The text the kit's language model learns and is measured on: the King James Bible, as
Debian's ``bible-kjv`` program prints it from the ``bible-kjv-text`` package.

Why this text: it is public domain (the translation is from 1611), a registry serves it
(Debian/Ubuntu's apt, ``bible-kjv-text`` 4.38, through ``apt-get download``), it is fixed
(one version, verified here by its SHA-256), and it is the same on every machine, which the
Python standard library's own sources are not (they change between Python 3.11 and 3.12). It
is 4,404,412 bytes of English prose, one verse a line with its reference (``Ge1:1 In the
beginning ...``): long chapters and book-level structure to give a recurrent model something to
remember.

``prepare(out)`` downloads the two packages with ``apt-get download`` (no root needed, but an
apt cache that ``apt-get update`` has filled), unpacks them with ``dpkg-deb -x`` into a
temporary folder, runs ``bible -f -p <data folder> gen1:1-rev22:21`` (``-f`` turns
pretty-printing off: one verse a line) and writes ``out/kjv.txt`` after checking its hash.

Split (``split``): the text is cut into blocks of 131,072 bytes; every eighth block (indices
7, 15, 23, 31) is held out, the rest (and the tail past the last whole block) is training
text. The held-out part is 524,288 bytes, 11.9 % of the text; each held-out block is one
contiguous 131,072-byte segment for ``experiments.model_drift``.

CI and the CPU presets need no registry: the first 65,536 bytes of the held-out stream are
committed as ``results/model_drift/kjv_heldout_64k.txt`` (``HELDOUT_SLICE``), checked
against the full text's split by ``python -m experiments.train_lm prepare-data``.
"""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
from pathlib import Path

from experiments._common import atomic_file

__all__ = ["TEXT_SHA256", "BLOCK", "EVERY", "HELDOUT_SLICE", "prepare", "load", "split",
           "heldout_slice"]

TEXT_NAME = "kjv.txt"
TEXT_SIZE = 4_404_412
TEXT_SHA256 = "cd45f0c9cedab8e4439bd6486c8952c77cc8b0ecc5d1f6ae3513f2039f47229d"
PACKAGES = ("bible-kjv", "bible-kjv-text")
BLOCK = 131_072
EVERY = 8  # block i is held out when i % EVERY == EVERY - 1
SLICE_BYTES = 65_536
HELDOUT_SLICE = Path(__file__).resolve().parent.parent / "results" / "model_drift" / \
    "kjv_heldout_64k.txt"


def _run(argv, cwd, what):
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True)
    except FileNotFoundError:
        raise RuntimeError(f"{what}: {argv[0]} not found (a Debian or Ubuntu machine has it)") \
            from None
    if done.returncode:
        err = done.stderr.decode(errors="replace").strip().splitlines()
        raise RuntimeError(f"{what}: {' '.join(argv)} exited {done.returncode}: "
                           f"{err[-1] if err else ''}")
    return done.stdout


def prepare(out) -> Path:
    """Download, unpack and print the text into ``out/kjv.txt`` (module docstring); returns
    its path. RuntimeError with one line if a step fails or the text's hash differs."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        _run(["apt-get", "download", *PACKAGES], tmp, "download (run apt-get update first)")
        root = Path(tmp) / "root"
        for deb in sorted(Path(tmp).glob("*.deb")):
            _run(["dpkg-deb", "-x", str(deb), str(root)], tmp, "unpack")
        text = _run([str(root / "usr/bin/bible"), "-f", "-p", str(root / "usr/lib"),
                     "gen1:1-rev22:21"], tmp, "print")
    digest = hashlib.sha256(text).hexdigest()
    if digest != TEXT_SHA256:
        raise RuntimeError(f"text: expected SHA-256 {TEXT_SHA256} ({TEXT_SIZE} bytes), got "
                           f"{digest} ({len(text)} bytes)")
    path = out / TEXT_NAME
    with atomic_file(path, "wb") as handle:
        handle.write(text)
    if HELDOUT_SLICE.is_file() and HELDOUT_SLICE.read_bytes() != heldout_slice(text):
        raise RuntimeError(f"{HELDOUT_SLICE}: expected the first {SLICE_BYTES} held-out bytes "
                           f"of the text, it differs")
    return path


def load(data) -> bytes:
    """The full text from a folder made by ``prepare`` (or the file itself), hash-checked."""
    path = Path(data)
    if path.is_dir():
        path = path / TEXT_NAME
    if not path.is_file():
        raise ValueError(f"data: expected {path} (made by `python -m experiments.train_lm "
                         f"prepare-data --out DIR`), it does not exist")
    text = path.read_bytes()
    digest = hashlib.sha256(text).hexdigest()
    if digest != TEXT_SHA256:
        raise ValueError(f"data: expected {path} with SHA-256 {TEXT_SHA256}, got {digest}")
    return text


def split(text: bytes) -> tuple[bytes, list[bytes]]:
    """``(train, held_out_blocks)``: every ``EVERY``-th block of ``BLOCK`` bytes is held out."""
    n = len(text) // BLOCK
    held = [text[i * BLOCK:(i + 1) * BLOCK] for i in range(n) if i % EVERY == EVERY - 1]
    train = b"".join(text[i * BLOCK:(i + 1) * BLOCK] for i in range(n)
                     if i % EVERY != EVERY - 1) + text[n * BLOCK:]
    return train, held


def heldout_slice(text: bytes | None = None) -> bytes:
    """The first ``SLICE_BYTES`` bytes of the held-out stream: from ``text`` if given, else the
    committed copy."""
    if text is None:
        if not HELDOUT_SLICE.is_file():
            raise ValueError(f"{HELDOUT_SLICE}: expected the committed held-out slice, missing")
        return HELDOUT_SLICE.read_bytes()
    return b"".join(split(text)[1])[:SLICE_BYTES]
