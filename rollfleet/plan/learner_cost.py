"""What a learner step costs, from the model's size and the cluster's FLOPs: the simulated
learner's ``seconds_per_token`` (weights) and ``seconds_per_token_squared`` (attention) when a plan
is given a model (``rollfleet plan --model-params-b``) instead of measured constants."""

from __future__ import annotations

import math


def _check(**values: float) -> None:
    """Every value > 0 (``gpus`` >= 1), or a ValueError naming the first that is not."""
    for name, value in values.items():
        if name == "gpus" and value < 1:
            raise ValueError(f"gpus must be >= 1, got {value}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value:g}")


def learner_seconds_per_token(
    params_b: float, gpus: int, tflops_per_gpu: float, mfu: float, flops_per_param_token: float = 6.0
) -> float:
    """Seconds of training per trained token on ``gpus`` accelerators for a model of ``params_b``
    billion parameters: ``flops_per_param_token`` (6: forward and backward, the usual estimate;
    add 2 per extra forward pass such as old log-probs or a reference model) x parameters, over
    the cluster's ``tflops_per_gpu`` peak at ``mfu`` utilisation."""
    _check(
        params_b=params_b,
        tflops_per_gpu=tflops_per_gpu,
        mfu=mfu,
        gpus=gpus,
        flops_per_param_token=flops_per_param_token,
    )
    return flops_per_param_token * params_b * 1e9 / (gpus * tflops_per_gpu * 1e12 * mfu)


def learner_seconds_per_token_squared(
    layers: int, hidden: int, gpus: int, tflops_per_gpu: float, mfu: float, flops_per_param_token: float = 6.0
) -> float:
    """Attention's share of the learner's time: seconds per squared sample length. A causal forward
    pass spends 4 x layers x hidden FLOPs per (token, earlier token) pair (scores, then values),
    length^2 / 2 pairs: 2 x layers x hidden x length^2 per sample. Backward costs twice the
    forward, as for the weights, so the total is ``flops_per_param_token`` (6) x layers x hidden
    x length^2."""
    _check(
        layers=layers,
        hidden=hidden,
        tflops_per_gpu=tflops_per_gpu,
        mfu=mfu,
        gpus=gpus,
        flops_per_param_token=flops_per_param_token,
    )
    return flops_per_param_token * layers * hidden / (gpus * tflops_per_gpu * 1e12 * mfu)


__all__ = ["learner_seconds_per_token", "learner_seconds_per_token_squared"]
