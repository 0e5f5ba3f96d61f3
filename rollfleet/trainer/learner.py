"""The learner: one Hugging Face causal LM trained with PPO-family losses on rollout batches.

It owns the policy model, an optional frozen reference model and the optimizer, and nothing about
*when* it runs: the trainer modes (sync, colocated async, separate async) decide that and call
:meth:`Learner.update` with a batch, :meth:`Learner.state_dict_for_inference` to push weights to
the fleet, and :meth:`Learner.save` / :meth:`Learner.load` around it.

Batch layout (what the agent loop produces): ``input_ids [B, P+R]`` = prompt left-padded to ``P``
then response right-padded to ``R``; ``attention_mask [B, P+R]``; ``position_ids [B, P+R]`` =
``cumsum(attention_mask) - 1`` clipped at 0; ``responses [B, R]``; ``response_mask [B, R]``;
``rollout_log_probs [B, R]`` (engine log probs, optional); ``scores [B]`` and ``uids`` (group
ids), or precomputed ``advantages [B, R]``. The log prob of response token ``t`` comes from the
logits at position ``P - 1 + t``.

Why one update looks the way it does: the proximal log probs (``old_log_probs``) are computed once
per update with no gradient, before any optimizer step, so every PPO epoch and mini-batch clips
around the same policy; the rollout log probs enter only through the decoupled-PPO weight (see
:mod:`rollfleet.trainer.algos.losses`). Gradients are accumulated over micro-batches with the
mini-batch's token (or sequence) count as denominator, so the result does not depend on
``micro_batch_size``. The model stays in eval mode throughout: dropout would make the first
ratio differ from 1 and bias the clip. Mixed precision as verl's FSDP actor: with a bfloat16 or
float16 ``dtype`` the policy's parameters and AdamW's state stay float32 and only the computation
runs in ``dtype`` (autocast): an update of a bfloat16 weight smaller than its resolution is lost,
and at ``lr`` 1e-6 that was nearly every one. Trade-off: no gradient checkpointing (it needs train
mode in transformers), no LR schedule, no FSDP; one device.
"""

from __future__ import annotations

import inspect
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from rollfleet.trainer.algos import compute_advantages, compute_policy_loss
from rollfleet.trainer.algos.losses import entropy_from_logits
from rollfleet.trainer.checkpoint import load_checkpoint, save_checkpoint
from rollfleet.trainer.learner_batch import BATCH_FIELD_ALIASES, LearnerBatch, PreparedBatch
from rollfleet.trainer.learner_config import LearnerConfig

if TYPE_CHECKING:  # transformers is imported when a model loads, not with this module
    from transformers import PreTrainedModel

#: Files copied from the model folder into every checkpoint, so a checkpoint is a model folder too.
MODEL_SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _MetricMean:
    """Reduces metric dicts: weighted means (the caller picks the weight, e.g. token counts),
    except keys ending in ``_max``, which reduce by max."""

    def __init__(self) -> None:
        self._sum: dict[str, float] = {}
        self._weight: dict[str, float] = {}

    def add(self, metrics: Mapping[str, float | torch.Tensor], weight: float = 1.0) -> None:
        for key, value in metrics.items():
            v = float(value)
            if key.endswith("_max"):
                self._sum[key] = max(self._sum.get(key, float("-inf")), v)
                self._weight[key] = 1.0
            else:
                self._sum[key] = self._sum.get(key, 0.0) + v * weight
                self._weight[key] = self._weight.get(key, 0.0) + weight

    def result(self) -> dict[str, float]:
        return {
            k: (s if k.endswith("_max") else s / self._weight[k]) for k, s in self._sum.items() if self._weight[k] > 0
        }


class Learner:
    """Policy model + optimizer + PPO update for one device. See the module docstring."""

    def __init__(self, model_path: str, config: Optional[LearnerConfig] = None) -> None:
        from rollfleet.models import get_model_path

        self.config = config or LearnerConfig()
        self.model_path = get_model_path(model_path)
        cfg = self.config
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.compute_dtype = _DTYPES[cfg.dtype]
        self.model = self._load(self.model_path, torch.float32)  # master weights: see the module docstring
        self.ref_model = None
        if cfg.loss.kl_loss_coef > 0:  # frozen: held in the compute dtype
            self.ref_model = self._load(get_model_path(cfg.ref_model_path or self.model_path), self.compute_dtype)
            self.ref_model.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
            eps=cfg.adam_eps,
        )
        #: Completed updates (one per :meth:`update` call); the checkpoint step.
        self.global_step = 0
        self._unknown_rollout_tokens = 0
        self._logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters

    def _load(self, path: str, dtype: torch.dtype) -> PreTrainedModel:
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"dtype": dtype}
        if self.config.attn_implementation is not None:
            kwargs["attn_implementation"] = self.config.attn_implementation
        # transformers' .to() is a functools.wraps'd method: its type loses the bound self
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(self.device)  # type: ignore[arg-type]
        model.eval()
        return model

    # ----------------------------------------------------------------------------- log probs

    def _forward(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        responses: torch.Tensor,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(log_probs [B, R], entropy [B, R] or None)`` in float32; differentiable."""
        r = responses.shape[-1]
        kwargs: dict[str, Any] = {"use_cache": False}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = r + 1  # skip the LM head on prompt positions
        mixed = self.compute_dtype != torch.float32
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=mixed):
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        logits = out.logits[:, -(r + 1) : -1, :].float() / self.config.temperature
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        entropy = entropy_from_logits(logits) if with_entropy else None
        return log_probs, entropy

    @torch.no_grad()
    def compute_log_probs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        responses: torch.Tensor,
        *,
        model: Optional[torch.nn.Module] = None,
    ) -> torch.Tensor:
        """Log probs ``[B, R]`` (float32, on the learner's device) of ``responses`` under the
        policy (or ``model``), in micro-batches, without gradient. Padding positions hold
        meaningless values: mask them with ``response_mask``."""
        model = model or self.model
        mb = self.config.micro_batch_size
        out = []
        for s in range(0, input_ids.shape[0], mb):
            ids, mask, pos, resp = (
                t[s : s + mb].to(self.device) for t in (input_ids, attention_mask, position_ids, responses)
            )
            out.append(self._forward(model, ids, mask, pos, resp)[0])
        return torch.cat(out)

    # ----------------------------------------------------------------------------- update

    def prepare(self, batch: Any) -> PreparedBatch:
        """Move a batch to the device and add advantages (unless given), proximal log probs and,
        with a KL loss, reference log probs. ``batch``: a ``LearnerBatch``, a ``RolloutBatch``-like
        object or a dict (see :meth:`LearnerBatch.from_any`)."""
        b = LearnerBatch.from_any(batch)
        dev = self.device
        response_mask = b.response_mask.to(dev)
        if b.advantages is not None:
            advantages = b.advantages.to(dev, torch.float32) * response_mask
        else:
            assert b.scores is not None and b.uids is not None  # LearnerBatch requires them without advantages
            advantages = compute_advantages(
                self.config.adv_estimator, b.scores.to(dev), b.uids, response_mask, **self.config.adv_options
            )
        inputs = (b.input_ids.to(dev), b.attention_mask.to(dev), b.position_ids.to(dev), b.responses.to(dev))
        old_log_probs = self.compute_log_probs(*inputs)
        rollout_log_probs = None
        if b.rollout_log_probs is not None:
            # NaN marks a log prob the engine did not give (a sample without any, a placeholder):
            # the proximal policy's stands in (weight 1) there. NaN, even off the mask, would
            # make the loss NaN and skip the whole step.
            rollout_log_probs = b.rollout_log_probs.to(dev, torch.float32)
            known = torch.isfinite(rollout_log_probs)
            rollout_log_probs = torch.where(known, rollout_log_probs, old_log_probs)
            self._unknown_rollout_tokens = int((~known & response_mask.bool()).sum())
        return PreparedBatch(
            *inputs,
            response_mask=response_mask,
            advantages=advantages,
            old_log_probs=old_log_probs,
            rollout_log_probs=rollout_log_probs,
            ref_log_probs=None if self.ref_model is None else self.compute_log_probs(*inputs, model=self.ref_model),
        )

    def accumulate_gradients(self, mini_batch: PreparedBatch) -> dict[str, float]:
        """Forward/backward ``mini_batch`` in micro-batches, adding to ``.grad`` (no optimizer step,
        no zeroing, no clipping). Losses use the mini-batch's token/sequence counts, so the
        accumulated gradient equals that of one full-batch pass. Returns the mini-batch metrics
        (``loss`` is the mini-batch loss)."""
        cfg = self.config
        mask = mini_batch.response_mask
        num_tokens = mask.sum()
        num_seqs = (mask.sum(-1) > 0).sum()
        with_entropy = cfg.loss.entropy_coeff > 0
        stats = _MetricMean()
        loss_total = 0.0
        for s in range(0, len(mini_batch), cfg.micro_batch_size):
            mb = mini_batch.select(slice(s, s + cfg.micro_batch_size))
            log_probs, entropy = self._forward(
                self.model, mb.input_ids, mb.attention_mask, mb.position_ids, mb.responses, with_entropy=with_entropy
            )
            out = compute_policy_loss(
                log_probs,
                mb.old_log_probs,
                mb.advantages,
                mb.response_mask,
                cfg.loss,
                rollout_log_probs=mb.rollout_log_probs,
                ref_log_probs=mb.ref_log_probs,
                entropy=entropy,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
            )
            out.loss.backward()
            loss_total += float(out.loss.detach())
            stats.add(out.metrics, weight=float(mb.response_mask.sum()))
        return {**stats.result(), "loss": loss_total, "num_tokens": float(num_tokens)}

    def _optimizer_step(self) -> tuple[float, bool]:
        """Clip and step; a non-finite gradient norm skips the step. Returns ``(grad_norm, stepped)``."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        if not torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm, False
        self.optimizer.step()
        return grad_norm, True

    def update(self, batch: Any) -> dict[str, float]:
        """One training step on a rollout batch: prepare once, then ``ppo_epochs`` x mini-batches
        (one optimizer step each) x micro-batches. Returns ``actor/*`` metrics: means over
        mini-batches, maxima for ``*_max`` keys."""
        cfg = self.config
        self._unknown_rollout_tokens = 0
        prepared = self.prepare(batch)
        n = len(prepared)
        mini = cfg.mini_batch_size or n
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.global_step)
        stats = _MetricMean()
        skipped = 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(n, generator=gen) if cfg.shuffle else torch.arange(n)
            for s in range(0, n, mini):
                self.optimizer.zero_grad(set_to_none=True)
                metrics = self.accumulate_gradients(prepared.select(order[s : s + mini]))
                # No token in the loss (every row masked: stale, unscored, exhausted): no step.
                # A zero gradient still moves AdamW's weights (momentum, decay).
                grad_norm, stepped = self._optimizer_step() if metrics["num_tokens"] > 0 else (0.0, False)
                skipped += not stepped
                stats.add({**metrics, "grad_norm": grad_norm})
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        mask = prepared.response_mask.bool()
        result = {f"actor/{k}": v for k, v in stats.result().items()}
        result.update(
            {
                "actor/lr": float(self.optimizer.param_groups[0]["lr"]),
                "actor/skipped_steps": float(skipped),
                # trained tokens whose rollout log prob was unknown (the proximal one stood in)
                "actor/rollout_log_probs_unknown": float(self._unknown_rollout_tokens),
                "actor/advantages_mean": float(prepared.advantages[mask].mean()) if mask.any() else 0.0,
                "actor/global_step": float(self.global_step),
            }
        )
        return result

    # ----------------------------------------------------------------------------- weights, checkpoints

    def state_dict_for_inference(self, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
        """The weights to push to inference engines: Hugging Face names exactly as in the model's
        safetensors files (a tied ``lm_head.weight`` is left out, as ``save_pretrained`` does and
        as vLLM's loaders expect), detached contiguous CPU *copies* (safe to hand to another
        thread while training goes on), in ``dtype`` (default: the compute dtype; floating-point
        tensors only are cast)."""
        return self._weights(dtype or self.compute_dtype)

    def _weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, t in _dedup_aliases(self.model.state_dict()).items():
            t = t.detach().to("cpu", dtype=dtype if t.is_floating_point() else t.dtype, copy=True)
            out[name] = t.contiguous()
        return out

    def save(
        self, root: str | Path, trainer_state: Optional[dict[str, Any]] = None, keep_last: Optional[int] = None
    ) -> Path:
        """Checkpoint weights, optimizer state, ``global_step`` and the caller's JSON
        ``trainer_state`` under ``root/step_<global_step>`` (atomically; see
        :mod:`rollfleet.trainer.checkpoint`). The folder is also a loadable model folder."""
        return save_checkpoint(
            root,
            self.global_step,
            self._weights(torch.float32),  # the master weights: a resume goes on from them exactly
            optimizer_state=self.optimizer.state_dict(),
            trainer_state=trainer_state,
            keep_last=keep_last or self.config.keep_last_checkpoints,
            write_extra=self._write_model_files,
        )

    def _write_model_files(self, folder: Path) -> None:
        self.model.config.save_pretrained(folder)
        src = Path(self.model_path)
        for name in MODEL_SIDE_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, folder / name)

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer state and ``global_step`` from a checkpoint folder (or the
        latest under a root); returns the saved ``trainer_state``."""
        ckpt = load_checkpoint(path, map_location=self.device)
        aliases = set(self.model.state_dict()) - set(_dedup_aliases(self.model.state_dict()))
        missing, unexpected = self.model.load_state_dict(ckpt.model_state, strict=False)
        if unexpected or set(missing) - aliases:
            raise ValueError(
                f"checkpoint '{ckpt.path}' does not match the model: missing {sorted(set(missing) - aliases)}, "
                f"unexpected {sorted(unexpected)}"
            )
        if ckpt.optimizer_state is not None:
            self.optimizer.load_state_dict(ckpt.optimizer_state)
        self.global_step = ckpt.step
        return ckpt.trainer_state


def _dedup_aliases(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop every entry that is the exact same memory as an earlier one (tied weights): the first
    name wins, which is the name ``save_pretrained`` keeps (``model.embed_tokens.weight`` over
    ``lm_head.weight``)."""
    seen: set[tuple[int, int | torch.SymInt, tuple[int, ...], tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


__all__ = ["LearnerConfig", "LearnerBatch", "PreparedBatch", "Learner", "MODEL_SIDE_FILES", "BATCH_FIELD_ALIASES"]
