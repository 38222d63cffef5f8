"""A torchtitan config registry for CPU runs of its fault-tolerance path.

torchtitan selects its configuration with ``--module M --config F``; M may
be any importable module, so the CPU settings live here, in torchtitan's
own configuration objects, rather than in patches:
``--module titan_config --config llama3_ft_cpu`` starts from torchtitan's
``llama3_torchft_debugmodel`` (its FT llama3 debug model and trainer) and
changes what a CPU run needs:

- Gloo as the cross-group process group (the debug config names NCCL);
- short sequences and small batches, float32 parameters under FSDP;
- no profiler, no validator, no activation checkpointing, no CUDA graphs;
- checkpointing on (torchtitan hands its state dict to the Manager only
  then) with an interval no run reaches, so nothing full is written.

Paths (tokenizer, data, dump folder) and the FT options (replica id, group
size, semi-sync method) come from the command line as torchtitan flags.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torchtitan.experiments.torchft.llama3.config_registry import llama3_torchft_debugmodel
from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer
from torchtitan.models.common.config_utils import make_gqa_config


def _unfused_qkv(model) -> None:
    """Separate wq/wk/wv projections instead of the debug model's fused wqkv.

    The fused module splits ``wqkv`` into wq/wk/wv in a ``state_dict`` hook
    by redistributing the FSDP-sharded DTensor: a collective on the replica
    group's mesh inside ``state_dict()`` and ``load_state_dict()``.  The
    Manager calls those on its own thread while the training thread runs
    FSDP's collectives, and a healing rank calls them while the other ranks
    of its group (already up to date) do not; with 2 ranks per group either
    one deadlocks the group.  torchtitan builds the same attention unfused
    when asked (``make_gqa_config(fuse_qkv=False)``); its state dict is then
    the ranks' own shards, no collective.  Same shapes, same initialisation
    (llama3's trunc_normal(std=0.02) for q, k, v).
    """
    init = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    for layer in model.layers:
        att = layer.attention
        layer.attention = make_gqa_config(
            dim=att.dim,
            n_heads=att.n_heads,
            n_kv_heads=att.n_kv_heads,
            head_dim=att.head_dim,
            wqkv_param_init=init,
            wo_param_init=att.wo.param_init,
            inner_attention=att.inner_attention,
            rope=att.rope,
            qk_norm=att.qk_norm,
            fuse_qkv=False,
        )


def llama3_ft_cpu() -> FaultTolerantTrainer.Config:
    config = llama3_torchft_debugmodel()
    _unfused_qkv(config.model_spec.model)
    config.profiler.enable_profiling = False
    config.validator.enable = False
    config.training.local_batch_size = 2
    config.training.seq_len = 64
    config.training.steps = 1_000_000  # the run is ended by its stop step
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    config.training.gc_freq = 1_000_000
    # A constant learning rate (no warmup, decay to 1.0 x lr): torchtitan
    # 0.3.0's FT state dict carries the optimizer's param groups as cached
    # when the trainer was built, and its LR scheduler's load_state_dict sets
    # only last_epoch, so a healed replica takes its first step with the
    # learning rate of step 0; with a schedule its parameters then differ
    # from the source's (docs/torchtitan.md).
    config.lr_scheduler.warmup_steps = 0
    config.lr_scheduler.decay_ratio = None
    config.lr_scheduler.min_lr_factor = 1.0
    config.dataloader.dataset = "c4_test"
    # FSDP2 over plain parameters (fully_shard on the group's mesh), the
    # layout torchft's FT-HSDP pattern expects; under the default
    # "spmd_types" backend fully_shard refuses the plain parameters it gets
    # on a CPU mesh of 2 ranks ("all parameters must be DTensors on the full
    # SPMD mesh").
    config.parallelism.spmd_backend = "partial_dtensor"
    config.checkpoint.enable = True
    config.checkpoint.interval = 1_000_000
    config.checkpoint.last_save_model_only = True
    config.comm.init_timeout_seconds = 120
    config.comm.train_timeout_seconds = 120
    config.fault_tolerance.process_group = "gloo"
    config.fault_tolerance.process_group_timeout_ms = 20_000
    config.fault_tolerance.semi_sync_method = None
    config.fault_tolerance.sync_steps = 4
    config.fault_tolerance.num_fragments = 1
    config.metrics.log_freq = 1
    config.activation_checkpoint = None
    return config
