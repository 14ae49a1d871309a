"""A wrapper's training data is drawn from nothing an evaluation reads (#69 item 4)."""

from __future__ import annotations

import json

from sparsecache.wrapper import data as wrapper_data
from sparsecache.measure import cloze
from sparsecache.bench import records
from sparsecache.measure import suite


def test_specimen_logs_share_no_name_pool_or_phrasing_with_any_evaluation_generator():
    used = set(suite.SYLLABLES) | set(suite.TRAIN_SYLLABLES) | {s for pool in records.SYLLABLES.values()
                                                                      for s in pool}
    assert not set(wrapper_data.SYLLABLES) & used
    assert not set(wrapper_data.KEEPERS) & (set(suite.GIVEN) | set(suite.TRAIN_GIVEN))
    asked = {q for _, q in wrapper_data.FIELDS.values()}
    evaluation = {q for kind in suite.KINDS.values() for _, qs in kind["facts"].values() for q in qs} | \
        {q for by_split in records.ASK.values() for qs in by_split.values() for q in qs}
    assert not asked & evaluation


def test_specimen_prompts_ask_a_fact_their_chunks_hold():
    prompts = wrapper_data.specimen_prompts(lambda text: list(text.encode()), 30, k=4, seed=1)
    assert len(prompts) == 30 and len({p["id"] for p in prompts}) == 30
    for p in prompts:
        texts = [bytes(c).decode() for c in p["chunks"]]
        assert len(texts) == 4 and len(set(texts)) == 4
        holder = [t for t in texts if t.split(chr(10))[0].removeprefix("Specimen log: ") in p["question"]]
        assert len(holder) == 1 and p["truth"] in holder[0]
    assert wrapper_data.specimen_prompts(lambda t: list(t.encode()), 30, k=4, seed=1) == prompts  # stable


def test_cloze_prompts_come_from_the_calibration_texts_train_part_not_the_demo_corpus():
    from sparsecache.text.documents import builtin_documents

    heldout = " ".join(" ".join(d.text.split()) for d in builtin_documents("heldout"))
    train = [d.text for d in builtin_documents("train")[:150]]
    windows = [{"chunks": [list(t[i:i + 600].encode()) for i in range(0, 2400, 600)]} for t in train if len(t) > 2400]
    prompts = wrapper_data.cloze_prompts(lambda ids: bytes(ids).decode(errors="ignore"), windows, 20)
    assert len(prompts) == 20
    for p in prompts:
        sentence = p["question"].split(':\n"', 1)[1].rsplit('"\nWhat goes', 1)[0]
        assert cloze.BLANK in sentence and sentence.replace(cloze.BLANK, p["truth"]) not in heldout
        assert any(p["truth"] in bytes(c).decode(errors="ignore") for c in p["chunks"])


def test_the_default_recipe_learns_from_specimens_cloze_and_text_only(tiny_model, tmp_path):
    from sparsecache.wrapper.learn import QUESTIONS_FROM, training_prompts
    from sparsecache.wrapper.config import WrapperConfig

    cfg = WrapperConfig(prompts=40, k=4)
    assert cfg.questions == "specimens+cloze"
    prompts = training_prompts(tiny_model, tmp_path, cfg)
    kinds = [p["id"].split("-")[0] if p["kind"] == "question" else "text" for p in prompts]
    assert len(prompts) == 40 and kinds.count("text") == 10 and kinds.count("cloze") == 15 \
        and kinds.count("specimen") == 15
    assert not (tmp_path / "train-suite").exists()  # the entity generator was not run
    assert json.loads((tmp_path / "prompts.json").read_text()) == prompts
    assert "no evaluation" in QUESTIONS_FROM[cfg.questions]
