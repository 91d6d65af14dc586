"""Composition of speculative decoding's `draft_model` method: the draft model loaded and checked against the
target, with its own KV pool and ModelRunner (`voltserve.spec.draft_model.DraftModelDrafter`)."""

from __future__ import annotations

import logging

from voltserve.config import EngineConfig
from voltserve.errors import ConfigError
from voltserve.kv_cache import BlockPool
from voltserve.models.llama import LlamaModel
from voltserve.runner import ModelRunner
from voltserve.spec.draft_model import DraftModelDrafter

logger = logging.getLogger(__name__)


def check_same_tokenizer(target, draft, name: str) -> None:
    """Drafts are token ids: the draft model must read and write the target's. Compares the two tokenizers'
    vocabularies (token text -> id), not their logits' widths (a padded vocabulary is fine).

    Raises:
        ConfigError: the vocabularies differ.
    """
    t_vocab, d_vocab = target.backend.get_vocab(), draft.backend.get_vocab()
    if t_vocab != d_vocab:
        differ = sum(1 for tok, i in d_vocab.items() if t_vocab.get(tok) != i) + len(t_vocab.keys() - d_vocab.keys())
        raise ConfigError(f"speculative_model {name!r} has another tokenizer than the model ({len(d_vocab)} vs "
                          f"{len(t_vocab)} tokens, {differ} differ): a draft model must share the target's")


def load_draft_model(config: EngineConfig, target_tokenizer, backend, max_model_len: int) -> LlamaModel:
    """Load `config.speculative_model` onto `backend` (the target's device and dtype), its rotary table as long
    as the target's context.

    Raises:
        LoaderError / UnsupportedModelError: from the loader.
        ConfigError: its tokenizer is not the target's (`check_same_tokenizer`).
    """
    from loaders import load_model

    loaded = load_model(config.speculative_model, gguf_convert=config.gguf_convert == "auto")
    check_same_tokenizer(target_tokenizer, loaded.tokenizer, config.speculative_model)
    cfg = loaded.config
    logger.info("draft model %s: %d layers, hidden %d, vocab %d", config.speculative_model, cfg.num_layers,
                cfg.hidden_size, cfg.vocab_size)
    if cfg.max_position_embeddings < max_model_len:
        logger.warning("draft model %s was trained for %d positions, the model's context is %d: its drafts past "
                       "that may pass less often", config.speculative_model, cfg.max_position_embeddings,
                       max_model_len)
    return LlamaModel(cfg, loaded.tensors, backend, loaded.quantized, max_positions=max_model_len,
                      fuse_mixed=config.gguf_convert == "auto")


def make_drafter(config: EngineConfig, model: LlamaModel, num_blocks: int, max_model_len: int,
                 vocab_size: int, device: str) -> DraftModelDrafter:
    """The drafter over `model` with a KV pool of `num_blocks` blocks (the target's count: a shadow never holds
    more than its target's tokens and k drafts) and, on a GPU unless `enforce_eager`, CUDA graphs for its
    decode steps and its catch-up steps (mixed graphs at the target's prefill buckets)."""
    backend = model.backend
    cfg = model.config
    kv = backend.allocate_kv_cache(cfg.num_layers, num_blocks, config.block_size, model.num_kv_heads, cfg.head_dim)
    graphs = None
    if device == "cuda" and not config.enforce_eager:
        from voltserve.graphs import StepGraphs, prefill_buckets

        mixed = prefill_buckets(config.max_num_batched_tokens) if config.mixed_graphs else []
        graphs = StepGraphs(model, backend, kv, config.max_num_seqs, max_model_len, mixed, None)
        graphs.capture()
    runner = ModelRunner(model, backend, kv, (), seed=0, graphs=graphs)
    logger.info("draft model KV pool: %d blocks x %d tokens (%.1f MiB)", num_blocks, config.block_size,
                kv.numel() * kv.element_size() / 2**20)
    pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
    return DraftModelDrafter(runner, pool, config.num_speculative_tokens, vocab_size,
                             max_chunk_tokens=config.max_num_batched_tokens, draft_vocab_size=cfg.vocab_size)
