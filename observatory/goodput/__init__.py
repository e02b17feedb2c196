"""Goodput planning: a simulation of a run at a scale this machine cannot hold (failures, loss
spikes, checkpoint tiers and retention), checked against Young/Daly and the published record."""

from spikewatch.observatory.goodput.engine import BUCKETS, Lanes, simulate
from spikewatch.observatory.goodput.model import (
    LLAMA3_CAUSES,
    LLAMA3_PER_GPU_DAY,
    Cause,
    Failures,
    Scenario,
    Spikes,
    Tier,
)

__all__ = [
    "BUCKETS",
    "LLAMA3_CAUSES",
    "LLAMA3_PER_GPU_DAY",
    "Cause",
    "Failures",
    "Lanes",
    "Scenario",
    "Spikes",
    "Tier",
    "simulate",
]
