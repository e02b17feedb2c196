"""Typed run configuration: one pydantic model per component, composed into `TrainConfig`.

Unknown keys and bad values are errors that name the dotted key and, where the type is a choice,
the allowed values. "Disabled" is `None`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from spikewatch.observatory.detect import DetectorConfig
from spikewatch.observatory.policy import PolicyConfig
from spikewatch.trainer.core.same_step import SameStepConfig
from spikewatch.trainer.core.watchdog import StallConfig

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "EvalConfig",
    "FaultConfig",
    "GuardConfig",
    "LoopConfig",
    "MixtureStage",
    "ModelConfig",
    "OptimConfig",
    "ProbesConfig",
    "ScheduleConfig",
    "TrainConfig",
]


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Section):
    vocab_size: int = Field(256, ge=2, description="Vocabulary size (256 for byte-level tokens).")
    n_layer: int = Field(2, ge=1, description="Number of transformer blocks.")
    n_head: int = Field(4, ge=1, description="Attention heads per block.")
    d_model: int = Field(128, ge=8, description="Residual stream width; divisible by n_head.")
    max_seq_len: int = Field(1024, ge=1, description="Longest sequence the RoPE table covers.")
    mlp_ratio: float = Field(
        4.0, gt=0, description="SwiGLU hidden size is 2/3 * mlp_ratio * d_model, rounded to 8."
    )
    qk_norm: bool = Field(False, description="RMSNorm on queries and keys per head (QK-norm).")
    z_loss: float | None = Field(
        None, ge=0, description="Coefficient on mean log^2 Z of the logits (PaLM); None = off."
    )
    attn_softcap: float | None = Field(
        None, gt=0, description="Soft-cap c*tanh(s/c) on attention logits; None = off."
    )
    final_softcap: float | None = Field(
        None, gt=0, description="Soft-cap c*tanh(x/c) on output logits; None = off."
    )
    norm_placement: Literal["pre", "reordered"] = Field(
        "pre", description="'pre': x + f(norm(x)); 'reordered' (OLMo 2): x + norm(f(x))."
    )
    tie_embeddings: bool = Field(False, description="Share the token embedding and output head.")
    init_std: float = Field(0.02, gt=0, description="Std of the normal init of weight matrices.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    norm_eps: float = Field(1e-5, gt=0, description="Epsilon of every RMSNorm.")
    attention: Literal["auto", "sdpa", "eager", "chunked", "triton"] = Field(
        "auto",
        description=(
            "Attention backend. 'auto': SDPA, with the max logit (when needed) from a separate "
            "pass, one fused kernel on CUDA; 'chunked' whenever an attention soft-cap is set. "
            "'eager' materialises QK^T; 'chunked' is blockwise; 'triton' (the fused flash "
            "attention, the max from its online softmax) needs CUDA (or TRITON_INTERPRET=1)."
        ),
    )
    attn_chunk: int = Field(128, ge=1, description="Query block size of the chunked backend.")

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if (self.d_model // self.n_head) % 2:
            raise ValueError("head dim d_model/n_head must be even for RoPE")
        if self.attention in ("sdpa", "triton") and self.attn_softcap is not None:
            raise ValueError(
                f"attention='{self.attention}' cannot apply attn_softcap; use 'chunked' or 'eager'"
            )
        return self


CorpusName = Literal["text", "code"]


class MixtureStage(_Section):
    until_step: int | None = Field(
        None, ge=1, description="This stage applies to steps < until_step; None = to the end."
    )
    weights: dict[CorpusName, float] = Field(
        description="Sampling weight per corpus ('text' = Shakespeare, 'code' = Python stdlib)."
    )

    @model_validator(mode="after")
    def _check_weights(self) -> MixtureStage:
        if any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError("mixture weights must be >= 0 with a positive sum")
        return self


class DataConfig(_Section):
    seq_len: int = Field(128, ge=2, description="Tokens per training sequence.")
    batch_size: int = Field(16, ge=1, description="Sequences per optimizer step (global batch).")
    micro_batch_size: int | None = Field(
        None, ge=1, description="Sequences per forward/backward; None = batch_size (no accum.)."
    )
    val_fraction: float = Field(
        0.1, gt=0, lt=1, description="Fraction of documents held out for validation."
    )
    code_max_bytes: int = Field(
        4_000_000, ge=10_000, description="Cap on the bytes of stdlib source read for 'code'."
    )
    blocklist: str | None = Field(
        None,
        description="A JSON-lines blocklist (`spikewatch quarantine`'s): training windows that "
        "overlap a sample it names ('corpus:offset' ids) are never drawn; None = none.",
    )
    stages: list[MixtureStage] = Field(
        default_factory=lambda: [MixtureStage(weights={"text": 1.0})],
        description="Mixture stages in order; the stage is a pure function of the step.",
    )

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        micro = self.micro_batch_size or self.batch_size
        if self.batch_size % micro:
            raise ValueError(
                f"batch_size={self.batch_size} must be a multiple of micro_batch_size={micro}"
            )
        if not self.stages:
            raise ValueError("stages must hold at least one stage")
        ends = [s.until_step for s in self.stages]
        if ends[-1] is not None or any(e is None for e in ends[:-1]):
            raise ValueError("only the last mixture stage may (and must) have until_step = None")
        inner = [e for e in ends[:-1] if e is not None]
        if inner != sorted(inner):
            raise ValueError("mixture stages must be ordered by until_step")
        return self


class OptimConfig(_Section):
    name: Literal["adamw", "muon", "muonclip"] = Field(
        "adamw", description="adamw; muon (Moonlight form, AdamW for non-matrix params); muonclip."
    )
    lr: float = Field(3e-3, gt=0, description="Peak learning rate (shared by Muon and AdamW).")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2).")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(
        0.1, ge=0, description="Decoupled weight decay; never on embeddings, norms or gains."
    )
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon Nesterov momentum.")
    ns_steps: int = Field(5, ge=1, description="Newton-Schulz iterations of Muon.")
    qk_clip_tau: float | None = Field(
        None,
        gt=0,
        description="QK-Clip threshold on the per-head max logit (any optimizer); None = off. "
        "muonclip defaults it to 100.",
    )
    grad_clip: float | None = Field(
        1.0, gt=0, description="Global gradient-norm clipping threshold; None = off."
    )

    @model_validator(mode="after")
    def _muonclip_tau(self) -> OptimConfig:
        for b in self.betas:
            if not 0 <= b < 1:
                raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        if self.name == "muonclip" and self.qk_clip_tau is None:
            self.qk_clip_tau = 100.0
        return self


class ScheduleConfig(_Section):
    name: Literal["cosine", "wsd", "constant"] = Field(
        "cosine", description="cosine: warmup + cosine to the floor; wsd: warmup-stable-decay."
    )
    warmup_steps: int = Field(30, ge=0, description="Linear warmup steps from 0 to the peak LR.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Floor as a fraction of the peak.")
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="WSD: fraction of max_steps spent in the final decay."
    )


class EvalConfig(_Section):
    interval: int | None = Field(
        50, ge=1, description="Evaluate every N steps (and at the end); None = only at the end."
    )
    batches: int = Field(8, ge=1, description="Validation batches per evaluation.")
    batch_size: int | None = Field(None, ge=1, description="None = data.micro_batch_size.")


class CheckpointConfig(_Section):
    interval: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        None,
        description="Save to disk every N steps (for crashes, and rollbacks further back than "
        "host memory holds); 'auto' = Young/Daly from the measured save time and mtbf_hours; "
        "None = no disk checkpoints.",
    )
    memory_interval: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        None,
        description="Snapshot to host memory every N steps (trainer/checkpoints/memory.py): a "
        "rollback restores from RAM, never waiting on disk; 'auto' = on a GPU, every k steps "
        "from the snapshot's measured cost (CheckFreq: at most 0.5% of the step time, k "
        "between 5 and 25), elsewhere 25; None = off.",
    )
    memory_budget_mb: float | None = Field(
        None,
        gt=0,
        description="Host memory the snapshots may take, per rank; None = a quarter of the "
        "host's available memory, shared by its ranks.",
    )
    keep_last: int = Field(
        2, ge=2, description="Newest checkpoints always kept (the newest may still be writing)."
    )
    async_save: bool = Field(
        False, description="Copy to host, write in a background thread (one save in flight)."
    )
    mtbf_hours: float = Field(
        24.0, gt=0, description="Mean time between failures, for interval = 'auto'."
    )
    fsync: bool = Field(True, description="fsync files and directories before the rename.")

    @property
    def any_tier(self) -> bool:
        """Some tier keeps rollback targets (without one, spikes are recorded, never acted on)."""
        return self.interval is not None or self.memory_interval is not None

    @field_validator("interval", "memory_interval", mode="before")
    @classmethod
    def _auto_word(cls, v: object) -> object:
        ok = v is None or v == "auto" or (type(v) is int and v >= 1)
        if not ok:
            raise ValueError(f"interval must be a positive integer, 'auto' or none, got {v!r}")
        return v


class ProbesConfig(_Section):
    enabled: bool = Field(True, description="Master switch of the per-step telemetry.")
    interval: int = Field(
        1, ge=1, description="Probe every N steps (loss, grad norm, LR are always recorded)."
    )
    state_interval: int = Field(
        10,
        ge=1,
        description="Update norms and optimizer-state statistics every N probed steps: each is "
        "a pass over all parameters (or moments), cheap on a GPU, ~1-5% of a CPU step each.",
    )
    grad_norms: bool = Field(True, description="Per-layer gradient norms.")
    update_norms: bool = Field(
        True, description="Per-layer parameter norm, update norm and update/parameter ratio."
    )
    optimizer_state: bool = Field(
        True, description="Per-layer Adam moment statistics or Muon momentum norm."
    )
    attn_max: bool = Field(
        True, description="Per-layer, per-head max attention logit (needs a backend that sees it)."
    )
    output_logits: bool = Field(True, description="Mean log-partition z and max output logit.")
    read: Literal["auto", "same_step", "next_step"] = Field(
        "auto",
        description="When the host reads a step's values: 'next_step' while the device computes "
        "the next step (the GPU never waits for the host; a rollback decided from step t "
        "happens at step t + 1's end, checkpoints wait for their step's values), 'same_step' at "
        "the step's end; auto = next_step on CUDA, same_step elsewhere (nothing is asynchronous "
        "there). A refused update is refused on its own step either way.",
    )


class LoopConfig(_Section):
    max_steps: int = Field(200, ge=1, description="Optimizer steps; the schedule targets this.")
    stop_after: int | None = Field(
        None, ge=1, description="End cleanly after this step, as a preemption would; None = run on."
    )
    seed: int = Field(0, ge=0, description="Seed of init, sampler and every RNG.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda if present.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="bfloat16 runs forward/backward under autocast; master weights fp32."
    )
    num_threads: int | None = Field(
        1, ge=1, description="torch CPU threads (1 is fastest on small machines); None = torch's."
    )
    progress: bool = Field(True, description="Show a live progress bar.")
    compile: bool = Field(
        False,
        description="torch.compile the training forward (evaluation stays eager): one graph "
        "with every probe on, two with probes.interval > 1 (probed and unprobed steps).",
    )


class GuardConfig(_Section):
    enabled: bool = Field(True, description="Run the spike detector on every step.")
    rollback: bool = Field(
        True,
        description="Act on spikes: roll back and skip (needs checkpoint.interval); false = "
        "detect and record only.",
    )
    detector: DetectorConfig = Field(
        default_factory=DetectorConfig, description="observatory/detect.py; its docstring."
    )
    policy: PolicyConfig = Field(
        default_factory=PolicyConfig, description="observatory/policy.py; its docstring."
    )
    classify_cause: bool = Field(
        True,
        description="After a rollback, replay the spike's steps once to tell a spike that "
        "needs this data with this state from a transient one (costs those steps once more).",
    )
    attribute_samples: bool = Field(
        True,
        description="At each rollback for a spike, measure every row of the batches it skips "
        "on the restored weights (loss and gradient norm) and name the rows that stand out "
        "(trainer/core/attribution.py): a forward and a backward per row, once.",
    )
    skip_samples: bool = Field(
        True,
        description="When the attribution names the rows that caused a spike, the rollback "
        "leaves out only those rows (refilled with fresh samples where the loader can) instead "
        "of the whole batches; unclear attributions skip the batches.",
    )
    stall: StallConfig = Field(
        default_factory=StallConfig, description="trainer/core/watchdog.py; its docstring."
    )
    same_step: SameStepConfig = Field(
        default_factory=SameStepConfig,
        description="trainer/core/same_step.py: refuse an isolated extreme update on its own step.",
    )


class DistributedConfig(_Section):
    strategy: Literal["ddp", "fsdp2"] | None = Field(
        None,
        description="'ddp': DistributedDataParallel; 'fsdp2': fully_shard (parameters, "
        "gradients and optimizer state sharded); both need torchrun. None = one process.",
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="Process-group backend; auto = nccl on CUDA, gloo on CPU."
    )
    timeout_s: float = Field(
        600.0, gt=0, description="Seconds a collective may wait for the other ranks."
    )


class FaultConfig(_Section):
    kind: Literal[
        "shifted_labels",
        "repeated_bytes",
        "random_bytes",
        "lr_scale",
        "nan_loss",
        "flaky_lr_scale",
        "lr_ramp",
        "bit_flip",
        "bad_device",
    ] = Field(description="What goes wrong (trainer/builtin/faults.py describes each).")
    start: int = Field(ge=0, description="First global batch index affected.")
    length: int = Field(1, ge=1, description="Number of consecutive batch indices affected.")
    factor: float = Field(
        30.0, gt=0, description="LR multiplier of 'lr_scale'; the final one of 'lr_ramp'."
    )
    rank: int | None = Field(
        None,
        ge=0,
        description="Only this rank's shard of the batch is affected (torchrun); None = every "
        "rank. Data kinds only: the learning rate is one for all ranks.",
    )
    rows: int | None = Field(
        None,
        ge=1,
        description="Only the first N rows of each affected global batch are spoilt; None = "
        "all of them. Data kinds only.",
    )

    @model_validator(mode="after")
    def _rank_only_for_data(self) -> FaultConfig:
        lr_kinds = ("lr_scale", "flaky_lr_scale", "lr_ramp", "nan_loss", "bit_flip", "bad_device")
        if self.rank is not None and self.kind in lr_kinds[:3]:
            raise ValueError(f"rank applies to data faults only, not kind='{self.kind}'")
        if self.rows is not None and self.kind in lr_kinds:
            raise ValueError(f"rows applies to data faults only, not kind='{self.kind}'")
        return self


class TrainConfig(_Section):
    name: str = Field("run", min_length=1, description="Run name; prefixes the run id.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model switches.")
    data: DataConfig = Field(default_factory=DataConfig, description="Corpus and batching.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="LR schedule.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Validation.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoints and retention."
    )
    probes: ProbesConfig = Field(default_factory=ProbesConfig, description="Telemetry.")
    train: LoopConfig = Field(default_factory=LoopConfig, description="The loop.")
    guard: GuardConfig = Field(
        default_factory=GuardConfig,
        description="The spike guard: detection and automatic rollback (was [watch]).",
    )
    faults: list[FaultConfig] = Field(
        default_factory=list, description="Injected faults (tests, demos); empty = none."
    )
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig, description="Several processes under torchrun."
    )

    @model_validator(mode="after")
    def _cross(self) -> TrainConfig:
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len="
                f"{self.model.max_seq_len}"
            )
        if self.schedule.warmup_steps >= self.train.max_steps:
            raise ValueError(
                f"schedule.warmup_steps={self.schedule.warmup_steps} must be < "
                f"train.max_steps={self.train.max_steps}"
            )
        self._check_distributed()
        return self

    def _check_distributed(self) -> None:
        strategy = self.distributed.strategy
        if strategy is None:
            return
        if self.checkpoint.async_save:
            raise ValueError(
                f"checkpoint.async_save is not supported with distributed.strategy='{strategy}' "
                "(sharded checkpoints are written synchronously by every rank)"
            )
        if strategy == "fsdp2" and self.optim.name != "adamw":
            raise ValueError(
                f"optim.name='{self.optim.name}' needs whole weight matrices (Newton-Schulz); "
                "under fsdp2 each rank holds a shard: use adamw, or distributed.strategy='ddp'"
            )
        if strategy == "fsdp2" and self.optim.qk_clip_tau is not None:
            raise ValueError(
                "optim.qk_clip_tau rescales per-head rows of W_q and W_k, which fsdp2 shards "
                "across ranks: use distributed.strategy='ddp'"
            )

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
