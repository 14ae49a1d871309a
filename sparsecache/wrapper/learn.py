"""Learning a chunk wrapper (`apply.py`) by self-distillation, the model frozen (KV Packet).

Teacher: the model's full prefill of `prefix + k chunks + question`, its greedy answer and its
next-token distributions along that answer (the top `top` log-probabilities per token, kept on
disk per prompt). Student: the same model reading the k chunks encoded one by one as
`prefix | header chunk trailer`, laid out one after another, nothing recomputed (a linked
wrapper, `WrapperConfig.linked`: every trailer recomputed in place after all the chunks before it,
the gradient flowing through that pass as well, as a query reads it). Loss: the
KL divergence from teacher to student on the answer's tokens. A share of the prompts are
running text instead (k consecutive pieces of calibration text and the text that follows them),
so wrapped chunks also continue text as the concatenation would.

Questions come from sources no evaluation draws from (`data.py`, #69): specimen logs
from a generator used nowhere else and cloze over the calibration text's train part (or, with
`questions="fidelity-train"`, the fidelity suite's generator with the `train` split's own
pools, how the wrapper shipped on 2026-11-28 was learned); the learning curve is measured on the dev split's first
questions (`none` with the wrapper against full prefill, as `bench fidelity` scores them).
Everything lives under the output directory: prompts, teacher targets, `checkpoint.pt`
(every `eval_every` steps; `resume` continues from it), `curve.json`/`curve.png`, the wrapper.
"""

from __future__ import annotations

import io
import json
import math
import random
from pathlib import Path

import torch

from ..durable import write_atomic
from ..model.cache import truncate
from ..model.generate import forced_agreement, full_prefill, greedy_continue, question_ids
from ..model.kvmodel import KVModel, default_prefix_ids, kv_cache
from .apply import Wrapper, continued, initial_wrapper, linked_logits, wrapped_ids, wrapped_kv
from .config import WrapperConfig

CHUNK_TOKENS = 512  # a suite document is one chunk of at most this many tokens
TEXT_PIECE = 256  # tokens per chunk of a running-text prompt
EVAL_ANSWER_TOKENS = 24  # as `bench fidelity` generates
TEXT_EVAL = 10  # held-out running-text prompts per learning-curve point (the held-out text holds ~10 at k = 8)
DEV_QUESTIONS = 200  # the learning curve reads the first questions of `bench fidelity --split dev --questions 200`


# ---------------------------------------------------------------- prompts

QUESTIONS_FROM = {"fidelity-train": "fidelity suite, train split",
                  "specimens+cloze": "specimen logs (a generator no evaluation uses) and cloze over the built-in "
                                     "calibration text (train part)"}


def _suite_prompts(model: KVModel, out: Path, n: int, cfg: WrapperConfig, split: str, first: int | None = None,
                   seed: int = 0) -> list[dict]:
    """Question prompts of the fidelity suite's `split` (as `make_suite(out, (k,), n, split=split)`
    makes them, with more entities where n needs them), chunks in the order a query lays them out
    (retrieval order reversed: the best chunk next to the question)."""
    from ..measure.suite import make_suite

    entities = max(40, cfg.k + 2, -(-n // 5))  # 40 below 200 questions, as `bench fidelity` makes them
    suite = make_suite(out, (cfg.k,), n, entities=entities, seed=seed, split=split)[cfg.k][:first]
    ids = _chunked(model, out / "corpus.jsonl")
    return [{"kind": "question", "chunks": [ids[d] for d in reversed(q.chunk_docs)],
             "question": question_ids(model, q.question), "truth": q.truth, "id": q.id} for q in suite]


def _chunked(model: KVModel, corpus: Path) -> dict[str, list[int]]:
    """Each document's token ids as a store holds them (`corpus.chunks`: a store's chunking and
    tokenisation, which full prefill's answers are sensitive to); a suite document is one chunk."""
    from ..text.corpus import chunks, scan

    out = {}
    for source in scan([str(corpus)]):
        pieces = list(chunks(source, model.tokenizer, CHUNK_TOKENS))
        if len(pieces) != 1:
            raise ValueError(f"{source.id}: {len(pieces)} chunks; a suite document must be one")
        out[source.id] = list(pieces[0].token_ids)
    return out


def _text_prompts(model: KVModel, n: int, cfg: WrapperConfig, split: str = "train") -> list[dict]:
    """Running-text prompts: k consecutive pieces of the built-in calibration text (its `split`
    part: train for training, heldout for the learning curve) and the `text_tokens` that follow them."""
    from ..text.documents import builtin_documents

    rng = random.Random(f"{cfg.seed}-text")
    docs = builtin_documents(split)
    rng.shuffle(docs)
    need = cfg.k * TEXT_PIECE + cfg.text_tokens + 1
    stream: list[int] = []
    out = []
    for d in docs:
        if len(out) == n:
            break
        stream += model.tokenizer(d.text + "\n\n", add_special_tokens=False)["input_ids"]
        while len(stream) >= need and len(out) < n:
            window, stream = stream[:need], stream[need:]
            out.append({"kind": "text", "chunks": [window[i * TEXT_PIECE:(i + 1) * TEXT_PIECE] for i in range(cfg.k)],
                        "text": window[cfg.k * TEXT_PIECE:]})
    return out


def training_prompts(model: KVModel, out: Path, cfg: WrapperConfig) -> list[dict]:
    """The training prompts (made once, kept in `out`/prompts.json), questions and text shuffled."""
    path = out / "prompts.json"
    if path.exists():
        return json.loads(path.read_text())
    n_text = round(cfg.prompts * cfg.text_share)
    n_questions = cfg.prompts - n_text
    if cfg.questions == "fidelity-train":
        prompts = _suite_prompts(model, out / "train-suite", n_questions, cfg, "train", seed=cfg.seed) \
            if n_questions else []
        prompts += _text_prompts(model, n_text, cfg)
    else:  # sources no evaluation draws from (#69): specimen logs, cloze over the calibration text's train part
        from .data import cloze_prompts, specimen_prompts

        windows = _text_prompts(model, 10 ** 6, cfg)  # every window of the train part
        cloze = cloze_prompts(lambda ids: model.tokenizer.decode(ids), windows, n_questions // 2, cfg.seed)
        tokenize = lambda text: model.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        made = cloze + specimen_prompts(tokenize, n_questions - len(cloze), cfg.k, cfg.seed)
        prompts = [{**q, "question": question_ids(model, q["question"])} for q in made] + windows[:n_text]
    random.Random(cfg.seed).shuffle(prompts)
    write_atomic(path, json.dumps(prompts))
    return prompts


# ---------------------------------------------------------------- teacher


@torch.no_grad()
def teacher_target(model: KVModel, prefix: list[int], prompt: dict, cfg: WrapperConfig) -> dict:
    """What the student is fitted to on one prompt: `inputs` (the tokens run after the context)
    and, for the last `n` of their positions, the full-prefill teacher's top log-probabilities."""
    context = prefix + [t for c in prompt["chunks"] for t in c]
    if prompt["kind"] == "question":
        q = prompt["question"]
        logits, cache = full_prefill(context + q, model)
        answer = greedy_continue(int(logits.argmax()), cache, len(context) + len(q), model, cfg.answer_tokens)
        answer = answer or [int(logits.argmax())]
        inputs, n = q + answer[:-1], len(answer)
    else:
        inputs, n = prompt["text"][:-1], len(prompt["text"]) - 1
    out = model.hf(input_ids=torch.tensor([context + inputs], device=model.device), logits_to_keep=n)
    logp = out.logits[0].float().log_softmax(-1)
    top = logp.topk(cfg.top, dim=-1)
    return {"inputs": inputs, "n": n, "idx": top.indices.to(torch.int32).cpu(), "logp": top.values.half().cpu()}


def _teacher(model: KVModel, prefix: list[int], prompts: list[dict], i: int, out: Path, cfg: WrapperConfig) -> dict:
    path = out / "teacher" / f"{i:05d}.pt"
    if path.exists():
        return torch.load(path)
    target = teacher_target(model, prefix, prompts[i], cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(target, buf)
    write_atomic(path, buf.getvalue())
    return target


def student_logits(model: KVModel, prefix: list[int], chunks: list[list[int]], ids: list[int],
                   header: torch.Tensor | None, trailer: torch.Tensor | None, linked: bool = False):
    """(float32 [len(ids), vocab], the cache): the logits after each of `ids` read after the wrapped
    chunks as a query reads them (a linked wrapper's trailers recomputed in place), and the cache
    holding the context and `ids`. Differentiable in the header and trailer."""
    keys, values = wrapped_kv(model, chunks, prefix, header, trailer)
    if linked and trailer is not None and trailer.shape[0]:
        context, links = wrapped_ids(prefix, chunks, header.shape[0], trailer.shape[0])
        return linked_logits(model, keys, values, context, links, ids, torch.cat([header, trailer]))
    cache = kv_cache(keys, values, model)
    return continued(model, cache, keys.shape[1], ids), cache


def distillation_loss(model: KVModel, prefix: list[int], chunks: list[list[int]], target: dict,
                      header: torch.Tensor, trailer: torch.Tensor, linked: bool = False) -> torch.Tensor:
    """KL(teacher ‖ student) per answer token, mean, over the teacher's top tokens (renormalised)."""
    logits = student_logits(model, prefix, chunks, target["inputs"], header, trailer, linked)[0][-target["n"]:]
    student = logits.log_softmax(-1).gather(-1, target["idx"].long().to(logits.device))
    teacher = target["logp"].float().to(logits.device).log_softmax(-1)
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


# ---------------------------------------------------------------- the learning curve


@torch.no_grad()
def answer(model: KVModel, prefix: list[int], chunks: list[list[int]], header: torch.Tensor | None,
           trailer: torch.Tensor | None, q: list[int], reference: list[int] | None, linked: bool = False,
           max_new_tokens: int = EVAL_ANSWER_TOKENS) -> tuple[str, list[int], float | None]:
    """Greedy answer to question tokens `q` after the wrapped chunks (`student_logits`), and the share
    of `reference`'s tokens it predicts teacher-forced (as `query --compare` does)."""
    logits, cache = student_logits(model, prefix, chunks, q, header, trailer, linked)
    logits = logits[-1]
    position = cache.get_seq_length()
    agreement = None
    if reference:
        agreement = forced_agreement(logits, cache, position, reference, model) / len(reference)
        truncate(cache, position)
    tokens = greedy_continue(int(logits.argmax()), cache, position, model, max_new_tokens)
    return model.tokenizer.decode(tokens, skip_special_tokens=True).strip(), tokens, agreement


@torch.no_grad()
def text_fidelity(model: KVModel, prefix: list[int], texts: list[dict], header: torch.Tensor | None = None,
                  trailer: torch.Tensor | None = None, full: list[list[int]] | None = None,
                  as_full: bool = False, linked: bool = False) -> dict:
    """Running text after pieces of it: the continuation's perplexity, its top-1 predictions
    (`top1`) and, given full prefill's (`full`), how often they agree (`text_top1`). The pieces are
    read encoded alone (header/trailer None), wrapped, or by full prefill itself (`as_full`)."""
    nll, n, same, top1 = 0.0, 0, 0, []
    for t in texts:
        cont = t["text"]
        if as_full:
            ctx = prefix + [x for c in t["chunks"] for x in c]
            out = model.hf(input_ids=torch.tensor([ctx + cont[:-1]], device=model.device))
            logits = out.logits[0, -(len(cont) - 1):].float()
        else:
            logits = student_logits(model, prefix, t["chunks"], cont[:-1], header, trailer, linked)[0]
        target = torch.tensor(cont[1:], device=logits.device)
        nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        n += len(target)
        top1.append(logits.argmax(-1).tolist())
        if full is not None:
            same += sum(a == b for a, b in zip(top1[-1], full[len(top1) - 1]))
    out = {"text_ppl": math.exp(nll / max(1, n)), "text_tokens": n, "top1": top1}
    if full is not None:
        out["text_top1"] = same / max(1, n)
    return out


def evaluate(model: KVModel, prefix: list[int], questions: list[dict], full: list[dict],
             header: torch.Tensor | None, trailer: torch.Tensor | None, progress: bool = False,
             texts: list[dict] | None = None, text_full: list[list[int]] | None = None, linked: bool = False) -> dict:
    """`none` from wrapped chunks (raw K/V, nothing recomputed but a linked wrapper's trailers) against
    full prefill on `questions`, and with `texts` (held-out running text) its continuation against full
    prefill's (`text_full`)."""
    from tqdm import tqdm

    from ..measure.answers import contains

    right, agree = [], []
    for q, f in tqdm(list(zip(questions, full)), desc="dev questions", leave=False, disable=not progress):
        text, _, a = answer(model, prefix, q["chunks"], header, trailer, q["question"], f["tokens"], linked)
        right.append(contains(text, q["truth"]))
        agree.append(a or 0.0)
    full_right = [f["correct"] for f in full]
    both = sum(r and f for r, f in zip(right, full_right))
    text = text_fidelity(model, prefix, texts, header, trailer, text_full, linked=linked) if texts else {}
    text.pop("top1", None)
    return {"correct": sum(right) / len(right), "full_correct": sum(full_right) / len(right),
            "correct_vs_full": sum(right) / max(1, sum(full_right)),
            "right_where_full_right": both / max(1, sum(full_right)),
            "token_agreement": sum(agree) / len(agree), "questions": len(right), **text}


@torch.no_grad()
def full_answers(model: KVModel, prefix: list[int], questions: list[dict], progress: bool = False) -> list[dict]:
    from tqdm import tqdm

    from ..measure.answers import contains

    out = []
    for q in tqdm(questions, desc="full prefill (dev questions)", leave=False, disable=not progress):
        context = prefix + [t for c in q["chunks"] for t in c]
        logits, cache = full_prefill(context + q["question"], model)
        tokens = greedy_continue(int(logits.argmax()), cache, len(context) + len(q["question"]), model,
                                 EVAL_ANSWER_TOKENS)
        text = model.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        out.append({"tokens": tokens, "text": text, "correct": contains(text, q["truth"])})
    return out


def _eval_set(model: KVModel, prefix: list[int], out: Path, cfg: WrapperConfig, progress: bool
              ) -> tuple[list, list, dict, list, list]:
    """The dev split's first questions (the suite `bench fidelity --split dev` makes), full prefill's
    answers to them, held-out running text and full prefill's top-1 along it, and the plain
    (unwrapped) scores on both, computed once and kept in `out`."""
    path = out / "eval.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    if "questions" not in saved:
        questions = _suite_prompts(model, out / "dev-suite", DEV_QUESTIONS, cfg, "dev", first=cfg.eval_questions)
        saved = {"questions": questions, "full": full_answers(model, prefix, questions, progress)}
    if "texts" not in saved:  # (an eval.json from before held-out text was part of the curve gains it)
        texts = _text_prompts(model, min(cfg.eval_questions, TEXT_EVAL), cfg, "heldout")
        saved |= {"texts": texts, "text_full": text_fidelity(model, prefix, texts, as_full=True)["top1"]}
        saved["plain"] = evaluate(model, prefix, saved["questions"], saved["full"], None, None, progress,
                                  saved["texts"], saved["text_full"])
        write_atomic(path, json.dumps(saved))
    return saved["questions"], saved["full"], saved["plain"], saved["texts"], saved["text_full"]


# ---------------------------------------------------------------- training


def _lr(step: int, cfg: WrapperConfig) -> float:
    warm = max(1, cfg.steps // 20)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, cfg.steps - warm)))


def learn_wrapper(model: KVModel, out: str | Path, cfg: WrapperConfig = WrapperConfig(), resume: bool = False,
                  progress: bool = True) -> Wrapper:
    """Learn a wrapper for `model` into `out` (see the module docstring); returns it, also saved there."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint.pt"
    if ckpt.exists() and not resume:
        from ..errors import ConfigError
        raise ConfigError(f"{out} holds a checkpoint: pass --resume to continue it, or choose another --out")
    for p in model.hf.parameters():
        p.requires_grad_(False)
    prefix = default_prefix_ids(model)
    prompts = training_prompts(model, out, cfg)
    questions, full, plain, texts, text_full = _eval_set(model, prefix, out, cfg, progress)
    wrapper = initial_wrapper(model, cfg.header, cfg.trailer, cfg.linked)
    header, trailer = wrapper.header.requires_grad_(), wrapper.trailer.requires_grad_()
    opt = torch.optim.Adam([header, trailer], lr=cfg.lr)
    state = {"step": 0, "curve": [], "losses": []}
    if resume and ckpt.exists():
        saved = torch.load(ckpt)
        if saved["config"] != cfg.__dict__:
            from ..errors import ConfigError
            raise ConfigError(f"{ckpt} was made with other settings: {saved['config']}")
        with torch.no_grad():
            header.copy_(saved["header"])
            trailer.copy_(saved["trailer"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
    if not state["curve"]:
        state["curve"].append({"step": 0, "kl": None, **evaluate(model, prefix, questions, full, header.detach(),
                                                                  trailer.detach(), progress, texts, text_full,
                                                                  cfg.linked)})

    def checkpoint():
        buf = io.BytesIO()
        torch.save({"config": cfg.__dict__, "header": header.detach(), "trailer": trailer.detach(),
                    "opt": opt.state_dict(), "state": state}, buf)
        write_atomic(ckpt, buf.getvalue())
        write_atomic(out / "curve.json", json.dumps({"plain": plain, "curve": state["curve"]}, indent=1))

    bar = tqdm(range(state["step"], cfg.steps), initial=state["step"], total=cfg.steps, desc="learn-wrapper",
               unit="step", disable=not progress)
    for step in bar:
        i = step % len(prompts)
        target = _teacher(model, prefix, prompts, i, out, cfg)
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        loss = distillation_loss(model, prefix, prompts[i]["chunks"], target, header, trailer, cfg.linked)
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["losses"].append(loss.item())
        state["step"] = step + 1
        bar.set_postfix(kl=f"{sum(state['losses'][-20:]) / len(state['losses'][-20:]):.3f}")
        if state["step"] % cfg.eval_every == 0 or state["step"] == cfg.steps:
            recent = state["losses"][-cfg.eval_every:]
            state["curve"].append({"step": state["step"], "kl": sum(recent) / len(recent),
                                   **evaluate(model, prefix, questions, full, header.detach(), trailer.detach(),
                                              progress, texts, text_full, cfg.linked)})
            checkpoint()
    checkpoint()
    result = Wrapper(header.detach().clone(), trailer.detach().clone(), model.fingerprint(), linked=cfg.linked, meta={
        "recipe": {**cfg.__dict__, "teacher": "full prefill of prefix + k chunks + question (greedy answer)",
                   "questions": QUESTIONS_FROM[cfg.questions], "text": "built-in calibration text (train part)"},
        "eval": {"plain": plain, "final": state["curve"][-1], "split": "dev"}})
    result.save(out)
    plot_curve(out)
    return result


def plot_curve(out: Path) -> Path:
    """curve.png: correct relative to full prefill and token agreement on the dev questions against
    the step, the unwrapped `none` as a line, and the training KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads((Path(out) / "curve.json").read_text())
    steps = [p["step"] for p in data["curve"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key, colour in (("correct_vs_full", "C0"), ("right_where_full_right", "C1"), ("token_agreement", "C2"),
                        ("text_top1", "C3")):
        if key not in data["plain"]:
            continue
        a.plot(steps, [p.get(key) for p in data["curve"]], "o-", color=colour,
               label="held-out text: top-1 = full prefill's" if key == "text_top1" else key.replace("_", " "))
        a.axhline(data["plain"][key], color=colour, ls=":", lw=1)
    a.set(xlabel="step", title=f"dev split, {data['curve'][0]['questions']} questions (dotted: no wrapper)")
    a.legend(fontsize=8)
    kl = [(p["step"], p["kl"]) for p in data["curve"] if p["kl"] is not None]
    b.plot([s for s, _ in kl], [v for _, v in kl], "o-")
    b.set(xlabel="step", ylabel="KL(teacher ‖ student), mean per token", title="training loss")
    fig.tight_layout()
    path = Path(out) / "curve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
