"""Data-parallel training on the CPU with gloo: how prompts split over ranks, the global loss
normaliser, and `qerl-pipe train --nproc 2` (torchrun, 2 processes) against one process with the
same batch: same samples, rewards and kept groups, and the same adapter within float tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qerl_pipe.errors import QerlError
from qerl_pipe.launch import torchrun_command
from qerl_pipe.rl.algo.losses import LossNorm, PolicyLossConfig, policy_loss
from qerl_pipe.rl.loop.distributed import NVLS_OFF, Dist, disable_nvls, global_loss_norm, shard
from tests.stages.test_train_stage import ENGINE, TRAIN, cli, last_line, named

ROOT = Path(__file__).parents[2]


def e_on_odd_answers(completion: str, problem) -> float:
    """The share of 'e' for problems with an odd answer, 0 otherwise: flat groups for dynamic sampling."""
    return completion.count("e") / max(1, len(completion)) if int(problem.answer) % 2 else 0.0


# ---------------------------------------------------------------------- units


def test_prompts_split_into_contiguous_equal_shares_and_groups_stay_whole():
    shares = [shard(8, r, 4) for r in range(4)]
    assert [list(s) for s in shares] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    g = 4  # a rank's rows are its prompts' whole groups: global sequence ids start at share.start * G
    rows = [list(range(s.start * g, s.stop * g)) for s in shares]
    assert sum(rows, []) == list(range(8 * g))
    assert list(Dist().share(8)) == list(range(8))
    with pytest.raises(QerlError, match="multiple of 3"):
        shard(8, 0, 3)


class _TwoRanks(Dist):
    """A stand-in for two ranks' all-reduce: sum() adds the other rank's counts."""

    def __init__(self, other: list[float]):
        object.__setattr__(self, "other", other)

    def sum(self, values):
        return [float(a) + float(b) for a, b in zip(values, self.other)]


@pytest.mark.parametrize("loss", ["dapo", "grpo", "dr_grpo"])
def test_the_global_normaliser_makes_rank_losses_add_up_to_the_batch_loss(loss):
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 9, generator=gen)
    mask = (torch.rand(6, 9, generator=gen) > 0.3).float()
    advantages = torch.randn(6, generator=gen)
    cfg = PolicyLossConfig(loss, max_response_len=9)
    whole, _ = policy_loss(logp, advantages, mask, cfg)
    halves = [slice(0, 2), slice(2, 6)]  # uneven shares, as dynamic sampling can leave them
    counts = [LossNorm.of(mask[h]) for h in halves]
    parts = []
    for h, mine, theirs in zip(halves, counts, counts[::-1]):
        norm = global_loss_norm(mine, _TwoRanks([theirs.sequences, theirs.tokens]))
        assert norm == LossNorm.of(mask)
        parts.append(policy_loss(logp[h], advantages[h], mask[h], cfg, norm=norm)[0])
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-7, rtol=1e-6)


def test_launches_keep_nvlink_multicast_off():
    env = disable_nvls({"NCCL_NVLS_ENABLE": "1"})
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    assert env == NVLS_OFF
    command = torchrun_command(2, ["train", "--force"])
    assert command[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "qerl_pipe",
                           "train", "--force"]


def test_run_under_torchrun_is_refused_before_any_stage(tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages: [calibrate]\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = cli("run", recipe, "--artifacts", tmp_path / "store", ok=False)
    assert result.exit_code == 1 and "train --nproc N" in result.stderr
    assert not (tmp_path / "store").exists()


# ---------------------------------------------------------------------- 2 gloo processes vs 1

# B = 4 prompts x G = 4; dynamic sampling (flat groups dropped, more drawn: the ranks must agree),
# batch-scaled advantages (the std of every rank's rewards), DAPO's global token mean, mu = 2.
DP = ["--set", "train.steps=3", "--set", "train.eval_limit=0", "--set", "train.checkpoint_every=2",
      "--set", "train.dynamic_sampling.enabled=true", "--set", "train.dynamic_sampling.max_draws=3",
      "--set", "train.scale_rewards=batch", "--set", "train.mu=2", "--set", "train.micro_batch_size=3",
      "--set", "train.rewards.custom=[tests.rl.test_train_distributed:e_on_odd_answers]"]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_gloo_processes_train_like_one(tiny_llama, store_dir):
    one = last_line(cli("train", "--model", tiny_llama, "--artifacts", store_dir, "--build-missing", *ENGINE, *TRAIN,
                        *DP))
    (engine,) = named(store_dir, "build-engine-")
    args = ["train", "--nproc", "2", "--engine", engine, "--model", tiny_llama, "--artifacts", store_dir,
            *ENGINE, *TRAIN, *DP]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "qerl_pipe", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = Path(proc.stdout.strip().splitlines()[-1])  # one artifact line: rank 0's
    assert two != one and two.name.startswith("train-") and named(store_dir / ".runs", "train-") == []
    manifest = json.loads((two / "manifest.json").read_text())
    assert manifest["config"]["processes"] == 2 and manifest["summary"]["processes"] == 2
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step-000003"]
    again = subprocess.run([sys.executable, "-m", "qerl_pipe", *map(str, args)], env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.strip().splitlines() == [str(two)], again.stderr[-3000:]
    assert "train: up to date" in again.stderr  # rank 0 found it; the other rank followed

    # Sampling noise is keyed by global sequence ids and every rank sees the whole draw's rewards:
    # the same tokens, rewards and kept groups as one process, exactly (the weights agree to ~1e-7,
    # far from flipping a Gumbel argmax).
    ref, got = _metrics(one), _metrics(two)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert any(r["draws"] > 1 for r in ref), "the test should exercise dynamic sampling"
    for a, b in zip(ref, got):
        for key in ("reward_mean", "reward_std", "accuracy", "response_length_mean", "truncation_rate",
                    "zero_variance_fraction", "kept_groups", "draws", "train_tokens", "sigma", "lr"):
            assert b[key] == a[key], (a["step"], key)
        # Float32 sums in another order (below): observed relative differences ~1e-7 at step 1,
        # ~1e-6 by step 3 as the weights drift apart.
        for key in ("loss", "grad_norm", "entropy", "clip_fraction"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    # The adapters: float32 sums in another order (per-rank partial sums, then the all-reduce)
    # change gradients by a few ulps, and Adam, which divides each component by its own RMS,
    # turns that into a different step only for components whose gradient is itself near the
    # rounding noise; each component moves at most ~lr (2e-2) per step. One process with
    # micro_batch_size 16 instead of 3 differs from itself just as much (measured: relative
    # norm 2.7e-5, largest element 2.4e-4; 2 ranks vs 1: 3.1e-5, 2.1e-4). Bounds: 10x that norm,
    # and 5% of one Adam step per element (no component went the other way).
    ref_adapter, got_adapter = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (one, two))
    assert ref_adapter.keys() == got_adapter.keys()
    assert any(float(t.abs().max()) > 0 for k, t in ref_adapter.items() if "lora_B" in k)  # it did train
    diff = sum(float((got_adapter[k] - w).pow(2).sum()) for k, w in ref_adapter.items()) ** 0.5
    norm = sum(float(w.pow(2).sum()) for w in ref_adapter.values()) ** 0.5
    assert diff / norm < 3e-4
    assert max(float((got_adapter[k] - w).abs().max()) for k, w in ref_adapter.items()) < 1e-3


# ---------------------------------------------------------------------- the scaling benchmark's logic
