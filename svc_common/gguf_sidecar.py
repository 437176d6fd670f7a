"""A GGUF model's tokenizer, chat template and config as the files a model directory
has, for the services that read those files and never import torch (the scheduler's
tokenizer, the gateway's chat template). transformers converts them from the GGUF
metadata (it imports torch): `python -m tools.prepare_default_model --gguf FILE
--sidecar` writes them once into a folder keyed by the file's path, size and mtime,
and prints it; `model_files(path)` finds that folder for `--model FILE.gguf`.

    PAGEDSERVE_GGUF_CACHE   the folders' root (default ~/.cache/pagedserve/gguf)
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

# The tensor type llama.cpp's tools append to a file's name (model.Q4_1.gguf, model-Q4_K_M.gguf, model-f16.gguf).
_TYPE_SUFFIX = re.compile(r"[.-](I?Q\d\w*|B?F16|F32)$", re.IGNORECASE)


def is_gguf_path(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def served_name(path: str | Path) -> str:
    """The model id a launcher gives the gateway: a directory's name, or a GGUF file's
    name without .gguf and without the tensor type llama.cpp names it by (the format
    is in /v1/models' weight_format): SmolLM2-135M-Instruct.Q4_1.gguf serves as
    SmolLM2-135M-Instruct, the id of its converted checkpoint."""
    name = Path(path).name
    return _TYPE_SUFFIX.sub("", name.removesuffix(".gguf")) if is_gguf_path(path) else name


def sidecar_dir(gguf: str | Path) -> Path:
    path = Path(gguf).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("PAGEDSERVE_GGUF_CACHE", Path.home() / ".cache" / "pagedserve" / "gguf"))
    return root / f"{path.stem}-{key}"


def model_files(path: str | Path) -> Path:
    """The directory holding tokenizer.json & co. for a model directory or a GGUF file."""
    if not is_gguf_path(path):
        return Path(path)
    folder = sidecar_dir(path)
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{path}: its tokenizer is not extracted yet: run `python -m tools.prepare_default_model "
            f"--gguf {path} --sidecar` (writes {folder})"
        )
    return folder
