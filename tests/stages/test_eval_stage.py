"""`qerl-pipe eval` on a tiny model (CPU): the adapter is really applied (a run's adapter gives
what train's own after-evaluation saw; a random adapter changes the outputs), the whole answer is
graded, pass@1 is averaged over k samples, the report files agree with each other, bad inputs fail
before anything is written, and a re-run reuses the artifact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from qerl_pipe.engine import Rollouts
from qerl_pipe.rl.task.answers import extract_answer, is_correct
from qerl_pipe.rl.task.tasks import load_problems, render_prompt
from tests.conftest import read_json
from tests.stage_cli import cli, last_line, named

ENGINE = ["--set", "quantize.quality.perplexity=never", "--set", "engine.max_seq_len=128",
          "--set", "engine.max_batch=16", "--set", "engine.device=cpu"]
TRAIN = ["--set", "train.steps=2", "--set", "train.prompts_per_step=4", "--set", "train.group_size=4",
         "--set", "train.max_new_tokens=12", "--set", "train.temperature=0.25", "--set", "train.lr=2e-2",
         "--set", "train.eval_limit=8", "--set", "train.device=cpu", "--set", "train.lora.rank=4",
         "--set", "train.lora.alpha=8", "--set", "train.rewards.accuracy=0",
         "--set", "train.rewards.custom=[tests.stages.test_train_stage:letter_e]"]
# What train's after-evaluation ran: the first 8 additions drawn with seed 0 + 1, greedy, 12 tokens.
EVAL_AS_TRAIN = ["--set", "eval.data=arithmetic", "--set", "eval.limit=8", "--set", "eval.seed=1",
                 "--set", "eval.greedy=true", "--set", "eval.max_new_tokens=12", "--set", "eval.device=cpu"]
EVAL = ["--data", "arithmetic", "--limit", "6", "--set", "eval.max_new_tokens=12", "--set", "eval.device=cpu"]


def samples(art: Path) -> list[dict]:
    return [json.loads(line) for line in (art / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def pipeline(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """quantize -> build-engine -> train -> eval with `qerl-pipe run`, in one store for the module."""
    store = tmp_path_factory.mktemp("eval-store") / "artifacts"
    recipe = store.parent / "r.yaml"
    recipe.write_text(f"stages: [quantize, build-engine, train, eval]\nmodel:\n  source: {tiny_llama}\n")
    result = cli("run", recipe, "--artifacts", store, *ENGINE, *TRAIN, *EVAL_AS_TRAIN)
    (engine,), (run,), (quantized,) = (named(store, p) for p in ("build-engine-", "train-", "quantize-"))
    return {"store": store, "eval": last_line(result), "engine": store / engine, "run": store / run,
            "quantize": store / quantized, "recipe": recipe}


@pytest.fixture(scope="module")
def random_adapter(pipeline, tmp_path_factory) -> Path:
    """A PEFT adapter for the tiny model with random, clearly non-zero A and B."""
    from qerl_pipe.model.peft import save_adapter
    from qerl_pipe.model.lora import LoraSpec, lora_parameters
    from qerl_pipe.jobs.engine_artifact import load_engine

    spec = LoraSpec(2, 4, ("q", "v", "down"))
    model, _ = load_engine(pipeline["engine"], "cpu", lora=spec)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    out = tmp_path_factory.mktemp("adapter")
    save_adapter(model, spec, out, "tiny-llama")
    return out


def test_run_evaluates_the_trained_adapter_exactly_as_train_saw_it(pipeline):
    art, run, engine = pipeline["eval"], pipeline["run"], pipeline["engine"]
    assert art.name.startswith("eval-")
    manifest = read_json(art / "manifest.json")
    assert manifest["kind"] == "eval" and manifest["parents"] == [read_json(engine / "manifest.json")["id"],
                                                                  read_json(run / "manifest.json")["id"]]
    report = read_json(art / "report.json")
    assert report["adapter"]["applied"] and report["adapter"]["artifact"] == read_json(run / "manifest.json")["id"]
    assert report["adapter"]["logit_max_abs_delta"] > 0 and (report["adapter"]["rank"], report["adapter"]["alpha"]) == (4, 8)
    # Greedy on the same problems through the same engine: the responses train's after-eval wrote.
    after = [json.loads(line) for line in (run / "eval" / "after.jsonl").read_text().splitlines()]
    ours = samples(art)
    assert [s["problem_id"] for s in ours] == [a["id"] for a in after]
    assert [s["response"] for s in ours] == [a["completion"] for a in after]
    assert [s["correct"] for s in ours] == [a["correct"] for a in after]
    assert report["pass@1"] == read_json(run / "report.json")["eval_after"]["accuracy"]
    cli("verify", art)


def test_a_random_adapter_changes_the_outputs_and_a_rerun_reuses_the_artifact(pipeline, random_adapter):
    store, engine = pipeline["store"], pipeline["engine"]
    base = last_line(cli("eval", "--model", engine, "--greedy", *EVAL, "--artifacts", store))
    adapted = cli("eval", "--model", engine, "--adapter", random_adapter, "--greedy", *EVAL, "--artifacts", store)
    art = last_line(adapted)
    assert art != base and read_json(base / "report.json")["adapter"] is None
    report = read_json(art / "report.json")
    assert report["adapter"]["applied"] and report["adapter"]["logit_max_abs_delta"] > 0.1
    assert report["adapter"]["targets"] == ["q", "v", "down"] and report["adapter"]["artifact"] is None
    assert [s["response"] for s in samples(art)] != [s["response"] for s in samples(base)]
    manifest = read_json(art / "manifest.json")
    assert manifest["parents"] == [read_json(engine / "manifest.json")["id"]]  # a plain directory: no parent
    assert manifest["config"]["adapter"]["sha256"]["adapter_model.safetensors"] == report["adapter"]["sha256"][
        "adapter_model.safetensors"]

    again = cli("eval", "--model", engine.name, "--adapter", random_adapter, "--greedy", *EVAL, "--artifacts", store)
    assert last_line(again) == art and "eval: up to date" in again.stderr


def test_pass_at_1_is_averaged_over_k_samples_and_the_report_adds_up(pipeline):
    store = pipeline["store"]
    art = last_line(cli("eval", "--model", pipeline["engine"], "--adapter", pipeline["run"].name, *EVAL, "--k", "3",
                        "--set", "eval.temperature=1.0", "--artifacts", store))
    report, rows = read_json(art / "report.json"), samples(art)
    assert set(read_json(art / "manifest.json")["files"]) == {"report.json", "report.md", "samples.jsonl"}
    assert (report["problems"], report["samples_per_problem"], report["samples"]) == (6, 3, 18) and len(rows) == 18
    assert [r["sample"] for r in rows] == [0, 1, 2] * 6
    assert report["sampling"] == {**report["sampling"], "greedy": False, "temperature": 1.0, "top_p": 0.95}
    by_problem: dict[str, list[bool]] = {}
    for r in rows:
        assert r["extracted"] == extract_answer(r["response"], "arithmetic")
        assert r["correct"] == is_correct(r["extracted"], r["gold"], "arithmetic")
        assert r["finish_reason"] in ("stop", "length")
        by_problem.setdefault(r["problem_id"], []).append(r["correct"])
    assert len(by_problem) == 6 and report["correct_samples"] == sum(r["correct"] for r in rows)
    tokenizer = AutoTokenizer.from_pretrained(str(pipeline["engine"]))
    problems = load_problems("arithmetic", limit=6, seed=1)  # eval.seed's default: the held-out draw
    assert list(by_problem) == [p.id for p in problems]
    assert [r["prompt"] for r in rows[::3]] == [tokenizer.decode(render_prompt(tokenizer, p)) for p in problems]
    assert report["pass@1"] == pytest.approx(sum(sum(c) / 3 for c in by_problem.values()) / 6)
    assert report["pass@3"] == pytest.approx(sum(any(c) for c in by_problem.values()) / 6)
    assert report["response_tokens_mean"] == pytest.approx(sum(r["response_tokens"] for r in rows) / 18)
    assert report["truncation_rate"] == pytest.approx(sum(r["finish_reason"] == "length" for r in rows) / 18)
    # Sampled at T = 1 from a random model: the three samples of a problem are not copies.
    assert any(len({r["response"] for r in rows if r["problem_id"] == pid}) > 1 for pid in by_problem)
    md = (art / "report.md").read_text()
    assert "pass@3" in md and f"{report['pass@1']:.4f}" in md and "applied" in md


class ScriptedEngine:
    """Stands in for the engine: answers problem i with RESPONSES[i] (to test grading alone)."""

    responses: list[str] = []
    tokenizer = None

    def __init__(self, model, limits) -> None:
        self.model = model

    def generate(self, prompts, n=1, sampling=None) -> Rollouts:
        ids = [self.tokenizer.encode(self.responses[i], add_special_tokens=False) for i in range(len(prompts))
               for _ in range(n)]
        index = [i for i in range(len(prompts)) for _ in range(n)]
        return Rollouts(index, [s for _ in prompts for s in range(n)], ids, [[0.0] * len(t) for t in ids],
                        ["stop"] * len(ids))


def _readable_tokenizer(path, trust_remote_code=False):
    """The tiny test tokenizer has no decoder (it decodes to 'Ġ'-marked pieces); give it ByteLevel's
    so scripted responses come back as written."""
    from tokenizers import decoders

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.backend_tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def test_the_whole_answer_is_graded_not_its_first_character(pipeline, tmp_path, monkeypatch):
    import qerl_pipe.jobs.eval_job as evaluate

    cases = [("What is 70 + 2?", "72", "So it is \\boxed{7}.", False),  # QeRL's script counted this right
             ("What is 70 + 2?", "72", "70 + 2 = 72", True),
             ("Half of one?", "\\frac{1}{2}", "It is \\boxed{0.5}", True),  # math-verify
             ("What is 100 + 28?", "128", "\\boxed{12} or so", False),
             ("What is 1000 + 80?", "1080", "\\boxed{1,080}", True)]
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a, _, _ in cases))
    ScriptedEngine.responses = [r for _, _, r, _ in cases]
    ScriptedEngine.tokenizer = _readable_tokenizer(pipeline["engine"])
    monkeypatch.setattr(evaluate, "Engine", ScriptedEngine)
    monkeypatch.setattr(evaluate, "load_tokenizer", _readable_tokenizer)
    art = last_line(cli("eval", "--model", pipeline["engine"], "--data", data, "--greedy",
                        "--set", "eval.device=cpu", "--set", "eval.max_new_tokens=8", "--artifacts", pipeline["store"]))
    rows = samples(art)
    assert [r["response"] for r in rows] == [r for _, _, r, _ in cases]
    assert [r["correct"] for r in rows] == [ok for *_, ok in cases]
    assert [r["extracted"] for r in rows] == ["7", "72", "0.5", "12", "1,080"]
    assert read_json(art / "report.json")["pass@1"] == pytest.approx(3 / 5)


def test_an_adapter_from_a_model_source_or_a_quantize_artifact(pipeline, random_adapter, tiny_llama):
    store, engine = pipeline["store"], pipeline["engine"]
    engine_id = read_json(engine / "manifest.json")["id"]
    # A quantize checkpoint: the recipe's engine section gives the engine already built from it.
    via_ckpt = last_line(cli("eval", "--model", pipeline["quantize"], "--adapter", random_adapter, "--greedy",
                             *EVAL, *ENGINE, "--artifacts", store))
    assert read_json(via_ckpt / "manifest.json")["parents"] == [engine_id]
    # A model source: a bf16 engine is built for it, the adapter fits it too.
    via_source = last_line(cli("eval", "--model", tiny_llama, "--adapter", random_adapter, "--greedy", *EVAL,
                               *ENGINE, "--set", "engine.base_format=bf16", "--artifacts", store, "--build-missing"))
    (bf16_engine,) = [p for p in named(store, "build-engine-") if p != engine.name]
    assert read_json(via_source / "manifest.json")["parents"] == [bf16_engine.removeprefix("build-engine-")]
    assert read_json(via_source / "report.json")["model"]["base_format"] == "bf16"


def _foreign_adapter(src: Path, out: Path) -> Path:
    """The random adapter with the shapes of a model of hidden size 32 (another model)."""
    out.mkdir()
    tensors = {name: (t[:, :32] if ".lora_A." in name and "down_proj" not in name else
                      t[:32] if ".lora_B." in name and "down_proj" in name else t)
               for name, t in load_file(str(src / "adapter_model.safetensors")).items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    return out


def _dora_adapter(src: Path, out: Path) -> Path:
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    (out / "adapter_config.json").write_text(json.dumps({**read_json(src / "adapter_config.json"), "use_dora": True}))
    return out


@pytest.mark.parametrize("case, needle", [
    ("missing-data", "does not exist"),
    ("foreign-adapter", "does not fit"),
    ("dora-adapter", "use_dora is set"),
    ("missing-adapter", "does not exist"),
    ("engine-as-adapter", "not an adapter"),
    ("run-as-model", "is a train run (an adapter), not a model"),
    ("eval-as-model", "'eval' artifact, not a model"),
    ("greedy-k", "greedy decoding gives the same response 3 times"),
    ("too-long", "eval.max_new_tokens=200 leaves no room"),
])
def test_bad_inputs_fail_before_anything_is_written(pipeline, random_adapter, tmp_path, case, needle):
    store, engine = pipeline["store"], pipeline["engine"]
    args = {
        "missing-data": ["--model", engine, "--data", tmp_path / "nope.jsonl"],
        "foreign-adapter": ["--model", engine, "--adapter", _foreign_adapter(random_adapter, tmp_path / "foreign")],
        "dora-adapter": ["--model", engine, "--adapter", _dora_adapter(random_adapter, tmp_path / "dora")],
        "missing-adapter": ["--model", engine, "--adapter", tmp_path / "no-adapter"],
        "engine-as-adapter": ["--model", engine, "--adapter", engine],
        "run-as-model": ["--model", pipeline["run"]],
        "eval-as-model": ["--model", pipeline["eval"]],
        "greedy-k": ["--model", engine, "--set", "eval.greedy=true", "--k", "3"],
        "too-long": ["--model", engine, "--set", "eval.max_new_tokens=200"],
    }[case]
    if "--data" not in args:
        args += ["--data", "arithmetic", "--limit", "2"]
    before = named(store, "")
    result = cli("eval", *args, "--set", "eval.device=cpu", "--artifacts", store, ok=False)
    assert result.exit_code == 1, result.stdout
    assert result.stderr.strip().startswith("error:") and len(result.stderr.strip().splitlines()) == 1
    assert needle in result.stderr, result.stderr
    assert named(store, "") == before and not named(store, ".tmp-")  # nothing written, nothing half-written


def test_run_checks_the_eval_data_before_the_first_stage(pipeline, tmp_path):
    result = cli("run", pipeline["recipe"], "--artifacts", tmp_path / "store", *ENGINE, *TRAIN, *EVAL_AS_TRAIN,
                 "--set", f"eval.data={tmp_path / 'nope.jsonl'}", ok=False)
    assert result.exit_code == 1 and "does not exist" in result.stderr
    assert not (tmp_path / "store").exists()


def test_problems_too_long_for_the_engine_are_skipped_and_reported(pipeline):
    art = last_line(cli("eval", "--model", pipeline["engine"], "--data", "gsm8k:test", "--limit", "3", "--greedy",
                        "--set", "eval.max_new_tokens=16", "--set", "eval.device=cpu", "--artifacts", pipeline["store"]))
    report = read_json(art / "report.json")
    kept = {r["problem_id"] for r in samples(art)}
    assert report["problems"] + report["skipped_problems"] == 3 and report["skipped_problems"] > 0
    assert kept.isdisjoint(report["skipped_ids"]) and len(kept) == report["problems"]
    assert report["pass@1_all_problems"] == pytest.approx(report["pass@1"] * report["problems"] / 3)
    assert "were skipped" in (art / "report.md").read_text()


def test_adapter_directories_are_read_from_their_files(random_adapter, tmp_path):
    import math
    import shutil

    from qerl_pipe.model.peft import read_adapter

    found = read_adapter(random_adapter)
    assert (found.spec.rank, found.spec.alpha, found.spec.targets, found.spec.train_norms) == (2, 4, ("q", "v", "down"),
                                                                                             False)
    # Another stage's layout: the adapter in the only subdirectory that holds one.
    shutil.copytree(random_adapter, tmp_path / "export" / "peft")
    assert read_adapter(tmp_path / "export").dir == tmp_path / "export" / "peft"
    # rsLoRA scales by alpha / sqrt(r): the same update as plain LoRA with alpha * sqrt(r).
    config = read_json(random_adapter / "adapter_config.json")
    (tmp_path / "export" / "peft" / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    assert read_adapter(tmp_path / "export").spec.alpha == pytest.approx(4 * math.sqrt(2))


def test_a_run_evaluated_over_another_engine_of_its_base_is_not_flagged(pipeline, tiny_llama, tmp_path):
    from qerl_pipe.artifacts import Artifact, ArtifactStore, load_artifact
    from qerl_pipe.lineage import base_mismatch

    store = ArtifactStore(pipeline["store"])  # holds the run and the engine it was trained over
    run = load_artifact(pipeline["run"])
    assert base_mismatch(run, load_artifact(pipeline["engine"]), store) is None
    # Other engines go to a store of their own, so the module's store keeps one NVFP4 and one bf16 engine.
    other = tmp_path / "other"
    # Other limits, the same quantize artifact: the same frozen weights.
    wider = last_line(cli("build-engine", "--quantized", pipeline["quantize"], *ENGINE, "--set",
                          "engine.max_batch=8", "--artifacts", other))
    assert wider.name != pipeline["engine"].name
    assert base_mismatch(run, load_artifact(wider), store) is None
    # A bf16 engine of the original model: another base, said so.
    bf16 = last_line(cli("build-engine", "--model", tiny_llama, *ENGINE, "--set", "engine.base_format=bf16",
                         "--artifacts", other))
    note = base_mismatch(run, load_artifact(bf16), store)
    assert note is not None and "another base" in note and "bf16 base" in note and "nvfp4 base" in note
    # A manifest that does not say which base it holds is not taken for the same one.
    silent = load_artifact(wider)
    silent = Artifact(path=silent.path, manifest={**silent.manifest, "config": {}})
    note = base_mismatch(run, silent, store)
    assert note is not None and "do not say" in note


def test_eval_of_arithmetic_alone_draws_the_held_out_problems_not_the_training_pool(capsys):
    from qerl_pipe.recipe import load_recipe
    from qerl_pipe.stages.evaluate import load_eval_problems

    recipe = load_recipe(None, ['eval.data="arithmetic"', "eval.limit=16"])
    drawn = load_eval_problems(recipe)
    train_pool = load_problems(recipe.train.data, seed=recipe.train.seed)
    held_out = load_problems("arithmetic", limit=16, seed=recipe.train.seed + 1)  # what train evaluates on
    assert [p.id for p in drawn] == [p.id for p in held_out]
    assert not {p.id for p in drawn} & {p.id for p in train_pool}
    assert "training pool" not in capsys.readouterr().err
    load_eval_problems(load_recipe(None, ['eval.data="arithmetic"', "eval.seed=0"]))
    assert "is the training pool (train.seed 0); eval.seed=1 gives" in capsys.readouterr().err
