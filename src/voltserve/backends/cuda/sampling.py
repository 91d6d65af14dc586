"""DeviceSampling: CudaBackend's sampling kernels (ptx/sampling.cu, ptx/sample_topk_topp.cu,
ptx/sample_chunks.cu): greedy argmax, temperature / top-k / top-p / min-p sampling with logprobs, and
speculative sampling's draft checks.

A mixin: it needs the backend's `device`, `num_sms`, `_launch`, `_on_device`, `argmax_counters`,
`sample_counters`, `sample_hist` and `sample_chunks`.
"""

from __future__ import annotations

import ctypes
import math

import torch

from voltserve.backends.cuda import kernels
from voltserve.backends.cuda import params as P
from voltserve.transfer import to_device


class DeviceSampling:
    """The sampling half of CudaBackend (see the module docstring)."""

    def sample_greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy sampling on the device.

        Args:
            logits: [num_rows, vocab] fp32 or fp16, CUDA, contiguous last dim.
        Returns:
            (token_ids [num_rows] int64, logprobs [num_rows] fp32): argmax (first index on ties) and its
            log_softmax value.
        """
        if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"logits {tuple(logits.shape)} {logits.dtype}: need 2-D fp32/fp16, contiguous rows")
        rows, vocab = logits.shape
        ids = torch.empty(rows, dtype=torch.int64, device=self.device)
        logprobs = torch.empty(rows, dtype=torch.float32, device=self.device)
        if rows:
            # vocabulary chunks over many blocks, merged by the last one (arrival counter per row)
            chunks = min(kernels.ARGMAX_MAX_CHUNKS, math.ceil(vocab / kernels.ARGMAX_CHUNK))
            if rows > self.argmax_counters.numel():
                chunks = 1
            chunk = math.ceil(vocab / chunks)
            part = torch.empty(rows * chunks * 3 if chunks > 1 else 1, dtype=torch.float32, device=self.device)
            p = P.ArgmaxParams(logits.data_ptr(), ids.data_ptr(), logprobs.data_ptr(), part.data_ptr(),
                               self.argmax_counters.data_ptr(), logits.stride(0), rows, vocab, chunk, 0)
            self._launch("sampling", "argmax_logprob", {"LOGITS_F16": int(logits.dtype == torch.float16)},
                         (rows, chunks, 1), (1024 if chunks == 1 else 256, 1, 1), 0, p)
        return ids, logprobs

    def sample(self, logits: torch.Tensor, params_rows) -> tuple[torch.Tensor, torch.Tensor,
                                                                 tuple[torch.Tensor, torch.Tensor]]:
        """Sampling on the device: temperature, top-k, top-p, min-p with per-row Philox4x32-10, plus logprobs.

        Semantics are those of `voltserve.sampling.sample` for rows without penalties or min_tokens masking
        (ptx/sample_topk_topp.cu states the algorithm); temperature 0 is argmax.

        Args:
            logits: [num_rows, vocab] fp32 (or fp16), CUDA, contiguous last dim; vocab < 2^23.
            params_rows: sequence of `params.SampleRowParams` (one per row: seed, offset, temperature, top_p,
                min_p, top_k, num_logprobs in 0..SAMPLE_MAX_LOGPROBS; draft ignored), or a ctypes array of them.
        Returns:
            (token_ids [num_rows] int64, logprobs [num_rows] fp32 of the sampled tokens under log_softmax(logits),
            (top_ids [num_rows, 20] int64, top_logprobs [num_rows, 20] fp32)): the top `num_logprobs` entries of
            each row sorted by descending logprob (ties: lower id first); later entries are -1 / -inf.
            All on the device; no host sync here (one small host-to-device copy of the row params).
        Raises:
            ValueError: logits not 2-D fp32 / fp16 with contiguous rows, a params row count that differs, vocab
                too large, or a row's num_logprobs / top_p / min_p out of range.
        """
        return self._sample_rows(logits, params_rows)

    def sample_verify(self, logits: torch.Tensor, params_rows) -> torch.Tensor:
        """Speculative sampling's draft checks on the device for drafts proposed for certain (q a point mass, as
        n-gram lookup proposes; Leviathan et al. 2023): one launch of `sample` whose rows with a draft (the
        row param `draft` >= 0) pass with probability p(draft) under the row's temperature / top-k / top-p /
        min-p and draw their token from p without the draft (what a rejection samples); rows without one
        sample as `sample` does. Greedy rows (temperature 0) pass when the draft is the argmax.

        Args:
            logits, params_rows: as `sample` takes (num_logprobs should be 0: their logprobs are not returned,
                and a non-zero value still costs the kernel its top-n passes).
        Returns:
            [2, num_rows] int64 on the device, no host sync: row 0 the tokens, row 1 the checks (1 where the
            row's draft passed; 0 for rows without one). A span emits its drafts up to its first failing row,
            then that row's token (its last row's when every draft passes): `voltserve.spec.verify.accept_checked`.
        Raises:
            ValueError: as `sample`.
        """
        out = torch.empty(2, logits.shape[0], dtype=torch.int64, device=self.device)
        self._sample_rows(logits, params_rows, out)
        return out

    def _sample_rows(self, logits: torch.Tensor, params_rows, checked: torch.Tensor | None = None):
        """`sample`'s launch; with checked ([2, num_rows] int64) the tokens and draft checks go there
        (`sample_verify`)."""
        if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"logits {tuple(logits.shape)} {logits.dtype}: need 2-D fp32/fp16, contiguous rows")
        rows, vocab = logits.shape
        if len(params_rows) != rows:
            raise ValueError(f"{len(params_rows)} params rows for {rows} logits rows")
        if vocab >= kernels.SAMPLE_MAX_VOCAB:
            raise ValueError(f"vocab {vocab} >= {kernels.SAMPLE_MAX_VOCAB} is not supported by sample_topk_topp")
        top_n = kernels.SAMPLE_MAX_LOGPROBS
        chunkable, filtered = True, False  # every row one sample_chunks takes; some with top-p / min-p
        for r in params_rows:
            if not 0 <= r.num_logprobs <= top_n or not 0 < r.top_p <= 1 or not 0 <= r.min_p <= 1:
                raise ValueError(f"unsupported sampling row: num_logprobs {r.num_logprobs}, top_p {r.top_p}, "
                                 f"min_p {r.min_p}")
            chunkable = chunkable and _chunk_row(r, vocab)
            filtered = filtered or _filtered_row(r)
        ids = torch.empty(rows, dtype=torch.int64, device=self.device) if checked is None else checked[0]
        outputs = (ids, torch.empty(rows, dtype=torch.float32, device=self.device),
                   (torch.empty(rows, top_n, dtype=torch.int64, device=self.device),
                    torch.empty(rows, top_n, dtype=torch.float32, device=self.device)))
        if rows:
            arr = params_rows if isinstance(params_rows, ctypes.Array) else (P.SampleRowParams * rows)(*params_rows)
            # through pinned memory: a pageable copy would wait for the step in flight (the graph before it)
            dev_rows = to_device(torch.frombuffer(bytearray(arr), dtype=torch.uint8), self.device)
            chunks = self._sample_chunks(rows, vocab, filtered) if chunkable else 0
            self._launch_sample(logits, dev_rows, outputs, checked, chunks, filtered)
        return outputs

    def _sample_chunks(self, num_rows: int, vocab: int, filtered: bool = False) -> int:
        """Blocks a row of sample_chunks for a launch of `num_rows` rows that are all `_chunk_row`s (`filtered`:
        some are `_filtered_row`s), or 0: sample_topk_topp. A block a step of SAMPLE_CHUNK tokens while the
        launch has at most as many rows as SMs (more rows fill the GPU already, and each block pays fixed
        costs; H100: 64 x 49,152 plain 42.5 vs 50.4 us a block a row); with filtered rows, whose blocks wait for
        each other, at most one block an SM in all (every block resident); else one block a row, which walks the
        row in fewer passes than sample_topk_topp. VOLTSERVE_SAMPLE_CHUNKS=plain leaves launches with filtered rows
        to sample_topk_topp, off every launch."""
        if self.sample_chunks == "off" or (filtered and self.sample_chunks == "plain"):
            return 0
        steps = kernels.sample_chunk_count(vocab)
        if not filtered:
            return steps if num_rows <= min(self.num_sms, self.sample_counters.numel()) else 1
        if num_rows * steps <= self.num_sms:
            return steps
        return max(1, self.num_sms // num_rows)  # >= 2 blocks only for rows <= num_sms / 2: sample_hist's rows

    def _launch_sample(self, logits: torch.Tensor, dev_rows: torch.Tensor, outputs, checked: torch.Tensor | None,
                       chunks: int = 0, filtered: bool = False) -> None:
        """One sampler launch: logits [rows, vocab] as `sample` takes them, dev_rows the rows' SampleRowParams
        on the device, outputs `sample`'s (ids, logprobs, (top_ids, top_logprobs)), checked `sample_verify`'s
        [2, rows] (ids = checked[0]) or None; chunks: sample_chunks' blocks a row (`_sample_chunks`; filtered:
        some rows have top-p / min-p), 0: sample_topk_topp (a block a row). No copy; capturable (the benchmark
        times it so)."""
        ids, logprobs, (top_ids, top_lps) = outputs
        rows, vocab = logits.shape
        part = counters = hist = None
        if chunks > 1:  # the blocks' partials (and top-p candidates), arrival counters, top-p histograms
            part = torch.empty(rows * (chunks * kernels.SAMPLE_CHUNK_PART_FLOATS
                                       + (kernels.SAMPLE_CANDIDATES if filtered else 0)),
                               dtype=torch.float32, device=self.device)
            counters = self.sample_counters
            hist = self.sample_hist if filtered else None
        p = P.SampleParams(logits.data_ptr(), dev_rows.data_ptr(), ids.data_ptr(), logprobs.data_ptr(),
                           top_ids.data_ptr(), top_lps.data_ptr(), logits.stride(0), rows, vocab,
                           None if checked is None else checked[1].data_ptr(),
                           None if part is None else part.data_ptr(), None if counters is None else counters.data_ptr(),
                           None if hist is None else hist.data_ptr())
        op = "sample_chunks" if chunks else "sample_topk_topp"
        self._launch(op, op, {"LOGITS_F16": int(logits.dtype == torch.float16)}, (rows, max(chunks, 1), 1),
                     (1024, 1, 1), 0, p)

    def philox4x32_10(self, words: torch.Tensor) -> torch.Tensor:
        """Test hook: Philox4x32-10 as the sampler computes it.

        Args:
            words: [n, 6] int32 (bit patterns of u32): counter c0..c3, key k0, k1.
        Returns:
            [n, 4] int32 (bit patterns of u32) outputs, on the device.
        """
        words = self._on_device(words, torch.int32)
        n = words.shape[0]
        out = torch.empty(n, 4, dtype=torch.int32, device=self.device)
        if n:
            p = P.SampleParams(words.data_ptr(), None, None, None, out.data_ptr(), None, 6, n, 0, None, None, None,
                               None)
            self._launch("sample_topk_topp", "philox4x32_10_test", {"LOGITS_F16": 0}, (math.ceil(n / 128), 1, 1),
                         (128, 1, 1), 0, p)
        return out


def _chunk_row(r, vocab: int) -> bool:
    """A SampleRowParams that sample_chunks takes: no logprobs and, unless greedy (its filters are unused then),
    no top-k (or one >= vocab)."""
    return r.num_logprobs == 0 and (r.temperature <= 0.0 or r.top_k <= 0 or r.top_k >= vocab)


def _filtered_row(r) -> bool:
    """A sampled SampleRowParams with top-p or min-p: in sample_chunks its blocks wait for each other."""
    return r.temperature > 0.0 and (r.top_p < 1.0 or r.min_p > 0.0)
