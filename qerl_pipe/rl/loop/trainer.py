"""GRPO/DAPO of LoRA adapters (or of every weight: `adapter: full`) over one shared model, with AQN.

`Trainer.step` goes from prompts to optimizer step; `fit` adds checkpoints, resume and metrics.
Micro-batch gradients sum to the whole batch's; rank 0 alone writes metrics and checkpoints.
See docs/training.md, sections "One step" and "Several GPUs"."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qerl_pipe.engine import Engine, Rollouts, SamplingParams
from qerl_pipe.errors import QerlError
from qerl_pipe.log import heartbeat, log
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.full import FullTraining
from qerl_pipe.model.lora import lora_disabled, lora_parameters
from qerl_pipe.rl.algo.advantages import group_advantages, soft_overlong_penalty, zero_variance_groups
from qerl_pipe.rl.algo.aqn import clear_noise, draw_noise
from qerl_pipe.rl.algo.logprobs import sequence_logprobs
from qerl_pipe.rl.algo.losses import MISMATCH_MEANS, LossNorm, policy_loss
from qerl_pipe.rl.loop.checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint
from qerl_pipe.rl.loop.config import TrainConfig
from qerl_pipe.rl.loop.data_order import DataOrder
from qerl_pipe.rl.loop.distributed import Dist, global_loss_norm
from qerl_pipe.rl.loop.metrics import MetricsLog, step_progress
from qerl_pipe.rl.loop.schedule import step_seed, warmup_cosine
from qerl_pipe.rl.loop.shares import Draw, KeptGroups
from qerl_pipe.rl.task.rewards import score
from qerl_pipe.rl.task.tasks import Problem
from qerl_pipe.stops import Stopped, stop_after_step

# step_seed streams: sampling of the first draw, the AQN noise, then extra dynamic-sampling draws.
_SAMPLING, _NOISE = 0, 1


@dataclass
class Group:
    """The G responses to one prompt, with the engine's logprobs and the rewards."""

    prompt: list[int]
    responses: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    rewards: Tensor  # [G]
    advantages: Tensor | None = None  # [G], set by the trainer from the whole batch's rewards


@dataclass
class RolloutBatch:
    """Prompt + response per row, right-padded to the longest row; [N, T] unless noted."""

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor  # 1 on response tokens
    loss_mask: Tensor  # response tokens that count (overlong masking zeroes whole rows)
    rollout_logp: Tensor  # the engine's logprob of each response token
    advantages: Tensor  # [N]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def split(self, size: int) -> list["RolloutBatch"]:
        """Micro-batches of `size` rows, each cut to its own longest row."""
        out = []
        for start in range(0, len(self), size):
            rows = slice(start, start + size)
            width = int(self.attention_mask[rows].sum(1).max())
            out.append(RolloutBatch(*(t[rows, :width] for t in (
                self.input_ids, self.attention_mask, self.response_mask, self.loss_mask, self.rollout_logp)),
                self.advantages[rows]))
        return out


def build_batch(groups: Sequence[Group], advantages: Tensor, mask_overlong: bool, device: torch.device) -> RolloutBatch:
    rows = [(g.prompt, r, lp, f) for g in groups for r, lp, f in zip(g.responses, g.logprobs, g.finish_reasons)]
    n, width = len(rows), max(len(p) + len(r) for p, r, _, _ in rows)
    ids = torch.zeros(n, width, dtype=torch.long)
    attention, response = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width)
    rollout_logp = torch.zeros(n, width)
    for i, (prompt, tokens, logprobs, _) in enumerate(rows):
        end = len(prompt) + len(tokens)
        ids[i, :end] = torch.tensor(prompt + tokens)
        attention[i, :end] = 1
        response[i, len(prompt):end] = 1
        rollout_logp[i, len(prompt):end] = torch.tensor(logprobs)
    loss_mask = response.clone()
    if mask_overlong:
        loss_mask[torch.tensor([f == "length" for _, _, _, f in rows])] = 0
    return RolloutBatch(ids.to(device), attention.to(device), response.to(device), loss_mask.to(device),
                        rollout_logp.to(device), advantages.to(device))


class Trainer:
    """One RL run's state: the model (shared with `engine`), optimizer, LR schedule, data order, step."""

    def __init__(self, model: Decoder, engine: Engine, tokenizer, problems: Sequence[Problem],
                 prompts: Sequence[Sequence[int]], cfg: TrainConfig, stop_token_ids: tuple[int, ...],
                 dist: Dist | None = None):
        if engine.model is not model:
            raise ValueError("the engine must generate from the model being trained (one shared model)")
        self.model, self.engine, self.tokenizer, self.cfg = model, engine, tokenizer, cfg
        self.problems, self.prompts = list(problems), [list(p) for p in prompts]
        self.stop_token_ids = tuple(stop_token_ids)
        self.device = model.embed_tokens.weight.device
        model.gradient_checkpointing = cfg.gradient_checkpointing
        # Full fine-tuning: AdamW steps float32 masters of every weight, copied back into the
        # shared model after each step (model/full.py); LoRA: the adapter's own float32 tensors.
        self.full = FullTraining(model) if cfg.full else None
        self.params = self.full.masters if self.full is not None else lora_parameters(model)
        self.optimizer = make_optimizer(self.params, cfg)
        self.scheduler = warmup_cosine(self.optimizer, cfg.warmup_steps, cfg.steps)
        # Every rank walks the same data order and takes whole draws; each then samples its share.
        self.data = DataOrder(len(self.prompts), cfg.seed)
        self.dist = dist or Dist()
        self.share = self.dist.share(cfg.prompts_per_step)  # raises unless B splits evenly
        self.dist.broadcast_parameters(self.params)
        self._push()
        self.step_count = 0  # steps done

    def _push(self) -> None:
        """After the optimizer (or a broadcast) changed the masters: the shared model gets them."""
        if self.full is not None:
            self.full.push()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps beside the adapter, optimizer, scheduler and RNG states."""
        return {"step": self.step_count, "data": self.data.state_dict(),
                "aqn": {"schedule": self.cfg.aqn.kind, "sigma_start": self.cfg.aqn.sigma_start,
                        "sigma_end": self.cfg.aqn.sigma_end, "num_stages": self.cfg.aqn.num_stages,
                        "total_steps": self.cfg.steps}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["aqn"] != self.state_dict()["aqn"]:
            raise ValueError(f"checkpoint AQN schedule {state['aqn']} differs from this run's")
        self.step_count = state["step"]
        self.data.load_state_dict(state["data"])

    # ------------------------------------------------------------------ one step

    def step(self) -> dict[str, Any]:
        cfg, step = self.cfg, self.step_count
        started = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        sigma = cfg.aqn.sigma(step, cfg.steps)
        noise_gen = torch.Generator(device=self.device).manual_seed(step_seed(cfg.seed, step, _NOISE))
        draw_noise(self.model, sigma, noise_gen)
        groups, rollout = self._rollouts(step)
        kept = rollout.pop("kept_groups")  # over all ranks; this rank may hold none of them
        if not cfg.aqn_in_training:
            clear_noise(self.model)
        lr = self.scheduler.get_last_lr()[0]
        trained = time.perf_counter()
        update = self._update(groups) if kept else {"skipped": True}
        clear_noise(self.model)
        self.scheduler.step()
        self.step_count += 1
        done = time.perf_counter()
        cuda = self.device.type == "cuda"
        # The slowest rank sets the pace: report its times and the largest memory peak.
        train_seconds, step_seconds, peak_bytes = self.dist.max(
            [done - trained, done - started, torch.cuda.max_memory_allocated(self.device) if cuda else 0])
        return {
            "step": self.step_count, **rollout, **update, "sigma": sigma, "lr": lr,
            "kept_groups": kept,
            "train_tokens_per_s": update.get("train_tokens", 0) / train_seconds if train_seconds > 0 else 0.0,
            "train_seconds": train_seconds, "step_seconds": step_seconds,
            "peak_gpu_memory_gib": peak_bytes / 2**30 if cuda else None,
        }

    def _rollouts(self, step: int) -> tuple[list[Group], dict[str, Any]]:
        """Sample, score and keep groups (dynamic sampling: only groups with a reward spread); returns
        this rank's kept groups (advantages over the whole batch) and the metrics. Keep/stop use the
        whole draw's rewards: every rank decides alike, as one process would."""
        cfg, g = self.cfg, self.cfg.group_size
        kept: KeptGroups[Group] = KeptGroups(self.share, g, cfg.prompts_per_step)
        draws: list[Draw] = []
        for draw in range(cfg.max_draws if cfg.dynamic_sampling else 1):
            mine, out, whole = self._draw(step, draw)
            draws.append(whole)
            flat = zero_variance_groups(whole.rewards, g).tolist()
            for p in range(cfg.prompts_per_step):
                if cfg.dynamic_sampling and flat[p]:
                    continue
                rewards = whole.rewards[p * g:(p + 1) * g]
                kept.keep(p, rewards, lambda i: self._group(mine[i], out, i, rewards))
            if kept.full():
                break
        groups = [replace(group, advantages=adv) for group, adv in kept.with_advantages(cfg.scale_rewards)]
        all_rewards = torch.cat([d.rewards for d in draws])
        lengths = [n for d in draws for n in d.lengths]
        finishes = [f for d in draws for f in d.finish_reasons]
        seconds = sum(d.seconds for d in draws)
        n = len(lengths)
        question, completion = draws[0].sample  # one rollout as it was generated, so a run's answers can be read
        return groups, {
            "reward_mean": float(all_rewards.mean()),
            "reward_std": float(all_rewards.std()) if n > 1 else 0.0,
            "accuracy": sum(c for d in draws for c in d.correct) / n,
            "response_length_mean": sum(lengths) / n,
            "truncation_rate": finishes.count("length") / n,
            "zero_variance_fraction": float(zero_variance_groups(all_rewards, g).float().mean()),
            "draws": len(draws),
            "rollout_seconds": seconds,
            "rollout_tokens_per_s": sum(d.tokens for d in draws) / seconds if seconds > 0 else 0.0,
            "kept_groups": len(kept),
            "sample": {"question": question, "completion": completion, "reward": float(draws[0].rewards[0])},
        }

    def _group(self, problem: int, out: Rollouts, i: int, rewards: Tensor) -> Group:
        """The group of this rank's i-th prompt of a draw (problem `problem`), from its rollouts `out`."""
        rows = slice(i * self.cfg.group_size, (i + 1) * self.cfg.group_size)
        return Group(self.prompts[problem], out.tokens[rows], out.logprobs[rows], out.finish_reasons[rows], rewards)

    def _draw(self, step: int, draw: int) -> tuple[list[int], Rollouts, Draw]:
        """Sample and score this rank's share of one draw of B prompts; returns its problem
        indices, its rollouts, and the whole draw (every rank's share, gathered)."""
        cfg, g = self.cfg, self.cfg.group_size
        indices = self.data.take(cfg.prompts_per_step)  # all ranks take the whole draw: same data state
        mine = [indices[i] for i in self.share]
        seed = step_seed(cfg.seed, step, _SAMPLING if draw == 0 else draw + 1)
        params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                max_new_tokens=cfg.max_new_tokens, stop_token_ids=self.stop_token_ids, seed=seed)
        t0 = time.perf_counter()
        # Global sequence ids: the sampling noise of a sequence is then the one-process noise.
        out = self.engine.generate([self.prompts[i] for i in mine], n=g, sampling=params,
                                   first_sequence_id=self.share.start * g)
        seconds = time.perf_counter() - t0
        # Each rank drew its own rollouts: all ranks see the summed count, so all stop.
        self._refuse_non_finite("the rollout's log-probabilities", self.dist.sum([_non_finite(out.logprobs)])[0])
        texts = self.tokenizer.batch_decode(out.tokens, skip_special_tokens=True)
        scored = score(texts, [self.problems[i] for i in mine for _ in range(g)], cfg.rewards)
        rewards = torch.tensor(scored.rewards, dtype=torch.float32)
        if cfg.overlong_penalty:
            rewards += soft_overlong_penalty(torch.tensor(out.lengths), cfg.max_new_tokens, cfg.overlong_buffer)
        drawn = Draw(rewards, scored.correct, out.lengths, out.finish_reasons, out.generated_tokens, seconds,
                     (self.problems[mine[0]].question, texts[0]))
        return mine, out, drawn.gather(self.dist)

    def _logprobs(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        return sequence_logprobs(self.model, batch.input_ids, batch.attention_mask, batch.response_mask,
                                 self.cfg.temperature, self.cfg.logprob_chunk)

    @torch.no_grad()
    def _fixed_logprobs(self, micro: list[RolloutBatch], base: bool) -> list[Tensor]:
        """Logprobs that stay fixed during the updates: the policy before them, or the base model."""
        with lora_disabled(self.model) if base else nullcontext():
            return [self._logprobs(mb)[0] for mb in micro]

    def _advantages(self, groups: list[Group]) -> Tensor:
        if all(grp.advantages is not None for grp in groups):
            return torch.cat([grp.advantages for grp in groups]) if groups else torch.zeros(0)
        # Groups made outside _rollouts (tests): advantages over these groups alone.
        return group_advantages(torch.cat([grp.rewards for grp in groups]), self.cfg.group_size,
                                self.cfg.scale_rewards)

    def _update(self, groups: list[Group]) -> dict[str, Any]:
        """mu AdamW updates on this rank's groups (possibly none, with several ranks)."""
        cfg = self.cfg
        advantages = self._advantages(groups)
        if cfg.loss.kl_coef == 0 and not self.dist.sum([float(bool(advantages.any()))])[0]:
            return self._zero_signal_update()
        batch = build_batch(groups, advantages, cfg.overlong_mask, self.device) if groups else None
        micro = batch.split(cfg.micro_batch) if batch is not None else []
        # Whole-batch counts (every rank's) for every micro-batch.
        norm = global_loss_norm(LossNorm.of(batch.loss_mask) if batch is not None else LossNorm(0, 0), self.dist)
        old = self._fixed_logprobs(micro, base=False) if cfg.mu > 1 else [None] * len(micro)
        ref = self._fixed_logprobs(micro, base=True) if cfg.loss.kl_coef > 0 else [None] * len(micro)
        # Sums over the micro-batches, then over the ranks; entropy and mismatch of update 0 alone (the
        # rollout vs the trainer before this batch's updates).
        sums = dict.fromkeys(("loss", "clip_fraction", "kl", "tokens", "entropy", "response_tokens",
                              *MISMATCH_MEANS), 0.0)
        grad_norm = ratio_max = 0.0
        for update in range(cfg.mu):
            self.optimizer.zero_grad(set_to_none=True)
            for k, mb in enumerate(micro):
                logp, entropy = self._logprobs(mb)
                loss, m = policy_loss(logp, mb.advantages, mb.loss_mask, cfg.loss, old_logp=old[k],
                                      ref_logp=ref[k], rollout_logp=mb.rollout_logp, norm=norm, mismatch=update == 0)
                loss.backward()
                tokens = int(mb.loss_mask.sum())
                sums["loss"] += float(loss.detach()) / cfg.mu
                sums["tokens"] += tokens
                for key in ("clip_fraction", "kl", *(MISMATCH_MEANS if update == 0 else ())):
                    sums[key] += m[key] * tokens
                if update == 0:
                    sums["entropy"] += float((entropy * mb.response_mask).sum())
                    sums["response_tokens"] += int(mb.response_mask.sum())
                    ratio_max = max(ratio_max, m["tis_ratio_max"])
            self.dist.sum_gradients(self.params)  # before clipping: every rank clips the same gradient
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else float("inf")
            grad_norm += float(torch.nn.utils.clip_grad_norm_(self.params, max_norm)) / cfg.mu
            self.optimizer.step()
            self._push()
        passes = cfg.mu + (cfg.mu > 1) + (cfg.loss.kl_coef > 0)  # forward passes over the batch
        sums["train_tokens"] = int(batch.attention_mask.sum()) * passes if batch is not None else 0
        # Each rank's loss is its share of the global loss: sums over ranks give the batch's figures.
        s = dict(zip(sums, self.dist.sum(list(sums.values()))))
        ratio_max = float(self.dist.max([ratio_max])[0])
        # Summed over ranks above (the gradient norm is of the summed gradients): the same on every rank.
        self._refuse_non_finite("the loss or its gradient", _non_finite([[s["loss"], grad_norm]]))
        tokens, first_pass = max(s["tokens"], 1), max(s["tokens"] / cfg.mu, 1)  # first_pass: update 0's tokens
        return {"loss": s["loss"], "clip_fraction": s["clip_fraction"] / tokens, "kl": s["kl"] / tokens,
                "grad_norm": grad_norm, "entropy": s["entropy"] / max(s["response_tokens"], 1),
                **{key: s[key] / first_pass for key in MISMATCH_MEANS}, "tis_ratio_max": ratio_max,
                "train_tokens": int(s["train_tokens"])}

    def _refuse_non_finite(self, what: str, bad: int) -> None:
        """Stop on `bad` NaN/inf values (a count every rank agrees on): rewards of garbage are all
        0, so training would go on, silently, with nothing to learn (or write NaN into the adapter)."""
        if bad:
            raise QerlError(
                f"train step {self.step_count}: {what} are not finite (NaN or inf), so the run stops before "
                "saving anything of this step; at the first step the base weights or the adapter are damaged "
                "(re-create the engine with `qerl-pipe build-engine --force`), after some steps training "
                "diverged (lower train.lr); re-running resumes from the last checkpoint")

    def _zero_signal_update(self) -> dict[str, Any]:
        """Every advantage is 0 (all groups flat) and there is no KL term: the loss and its gradient
        are exactly 0, so the forward/backward passes are skipped. AdamW still steps on zero
        gradients, as the full computation would (its momentum keeps moving the weights)."""
        for _ in range(self.cfg.mu):
            for p in self.params:
                p.grad = torch.zeros_like(p)
            self.optimizer.step()
            self._push()
        return {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "grad_norm": 0.0, "entropy": None,
                "train_tokens": 0, **dict.fromkeys((*MISMATCH_MEANS, "tis_ratio_max"), None)}


def make_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over `params`: torch's, or bitsandbytes' AdamW8bit (8-bit moments, blockwise scaled;
    CUDA tensors only: `check_optimizer` refuses it elsewhere before any work)."""
    if cfg.optimizer == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _non_finite(rows: Sequence[Sequence[float]]) -> int:
    return sum(not math.isfinite(v) for row in rows for v in row)


def fit(trainer: Trainer, run_dir: Path, checkpoint_every: int) -> list[dict[str, Any]]:
    """Run the remaining steps of `trainer` in `run_dir`, resuming from rank 0's latest checkpoint, with a
    checkpoint every `checkpoint_every` steps (0: at the end), after the last and on SIGINT / SIGTERM
    (after the step in progress). Returns every step's metrics (ranks > 0: this session's)."""
    total, dist = trainer.cfg.steps, trainer.dist
    checkpoint = dist.broadcast(latest_checkpoint(run_dir) if dist.is_main else None)
    if checkpoint is not None:
        trainer.load_state_dict(load_checkpoint(checkpoint, trainer.model, trainer.optimizer, trainer.scheduler,
                                                rank=dist.rank, full=trainer.full))
        if dist.is_main:
            log(f"train: resuming {run_dir} after step {trainer.step_count} of {total}")
    metrics = MetricsLog(run_dir, trainer.step_count) if dist.is_main else None
    records: list[dict[str, Any]] = []
    try:
        with step_progress(total, trainer.step_count) if dist.is_main else nullcontext(records.append) as update, \
                stop_after_step("train") as stop:
            while trainer.step_count < total:
                beat = heartbeat(f"train: step {trainer.step_count + 1}/{total}") if dist.is_main else nullcontext()
                with beat:  # a step of a large model on a CPU takes minutes: off a terminal, say it goes on
                    record = trainer.step()
                if metrics is not None:
                    metrics.append(record)
                update(record)
                done = trainer.step_count
                stopping = int(dist.max([stop.signum or 0])[0])  # every rank stops after the same step
                if stopping or done == total or (checkpoint_every and done % checkpoint_every == 0):
                    _checkpoint(trainer, run_dir, done)
                if stopping:
                    raise Stopped(stopping, f"after step {done} of {total}, saved in {run_dir}")
    finally:
        if metrics is not None:
            metrics.close()
    return metrics.records if metrics is not None else records


def _checkpoint(trainer: Trainer, run_dir: Path, done: int) -> None:
    """Rank 0 writes the checkpoint (with every rank's RNG states); the others wait until it is in place."""
    dist = trainer.dist
    rng_states = dist.all_gather(rng_state())
    if dist.is_main:
        save_checkpoint(run_dir, done, trainer.model, trainer.optimizer, trainer.scheduler, trainer.state_dict(),
                        rank_rng_states=rng_states if dist.enabled else None, full=trainer.full)
    dist.barrier()
