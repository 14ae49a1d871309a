"""How a chunk wrapper is learned (`sparsecache learn-wrapper`): a plain dataclass, importable
without torch, so the CLI states its defaults without loading it."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

# Shipped wrappers (dictionaries/, `wrapper.SHIPPED_WRAPPERS`) a new store of their model is encoded
# with unless told otherwise (`encode-corpus --wrapper none`): found by the model's fingerprint
# (#69: learned from data no evaluation reads, `learn-wrapper --questions specimens+cloze`; the wrapper learned on
# the entity suite's train split, smollm2-135m-wrapper-h16-t0, stays in the repository for the figures that cite it)
DEFAULT_WRAPPERS: tuple[str, ...] = ("smollm2-135m-wrapper-h16-t0-neutral",)
DEFAULT_WRAPPER_HELP = ", ".join(DEFAULT_WRAPPERS) or "none ships as a default yet"


QUESTION_SOURCES = ("specimens+cloze", "fidelity-train")


@dataclass(frozen=True)
class WrapperConfig:
    """The wrapper's lengths and its self-distillation recipe (`learn.learn_wrapper`)."""

    header: int = 16  # soft tokens before every chunk (KV Packet's 8 + 8 in count)
    trailer: int = 0  # soft tokens after every chunk: none, since a trailer hurts the text after the last chunk
    # the trailer recomputed at query time after every chunk before it (KVLink's link tokens, the model frozen),
    # and learned that way: a store encoded with it recomputes every chunk's trailer in every query (#94 item 3)
    linked: bool = False
    steps: int = 300  # one prompt per step: its k chunks re-encoded with gradients (~15 s on 2 CPU cores at k = 8)
    lr: float = 3e-3  # Adam's peak rate (warm-up, then cosine decay)
    k: int = 8  # chunks per training prompt
    prompts: int = 400  # distinct training prompts, cycled
    text_share: float = 0.25  # prompts that are running text (continue k chunks of calibration text), not questions
    # where the question prompts come from (#69): "specimens+cloze" (half synthetic specimen logs, a generator
    # no evaluation uses, half cloze over the calibration text's train part: `data.py`) or
    # "fidelity-train" (the entity suite's train split, how the wrapper shipped on 2026-11-28 was learned)
    questions: str = "specimens+cloze"
    answer_tokens: int = 24  # teacher's greedy answer: the tokens the loss is taken on
    text_tokens: int = 32  # continuation tokens of a running-text prompt
    top: int = 256  # teacher log-probabilities kept per token (the KL is taken over them, renormalised)
    eval_every: int = 50  # steps between learning-curve points (and checkpoints)
    eval_questions: int = 20  # dev-split questions per learning-curve point
    seed: int = 0

    def __post_init__(self):
        if self.header < 0 or self.trailer < 0 or self.header + self.trailer == 0:
            raise ConfigError(f"a wrapper needs a header or a trailer (got {self.header} + {self.trailer} tokens)")
        if self.linked and self.trailer < 1:
            raise ConfigError("--linked recomputes the trailer at query time: it needs --trailer >= 1")
        if self.k < 2:
            raise ConfigError(f"--k must be >= 2 (chunks per training prompt), got {self.k}")
        if self.questions not in QUESTION_SOURCES:
            raise ConfigError(f"--questions must be one of {', '.join(QUESTION_SOURCES)}, got {self.questions!r}")
        if not 0.0 <= self.text_share <= 1.0:
            raise ConfigError(f"--text-share must be in [0, 1], got {self.text_share}")
        for name in ("steps", "prompts", "answer_tokens", "text_tokens", "top", "eval_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
