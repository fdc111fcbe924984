"""A PyTorch engine for any HF causal LM: batched sampling with a KV cache, on CPU or CUDA.

Logprobs are those of the raw model: log_softmax of the logits at temperature 1,
before top-k/top-p. That is pi_old(token | prefix), the quantity the PPO ratio
needs, and what the trainer recomputes with a plain forward pass. The logprobs of
the distribution actually sampled (after temperature, top-k, top-p) come too, as
`sampling_logprobs`, for importance weights (0 when greedy). A `regex` in the
sampling params constrains the text token by token (RegexMask); the sampling
logprobs stay those of the unconstrained distribution (-inf for a token that the
constraint forced outside it).
"""

from __future__ import annotations

import random
import threading

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.engine.base import ENGINES, Engine, EngineOutput, ScoredTokens, WeightsRejected
from services.engine.state_dict import canonical_state_dict, non_finite, spec_of
from services.protocol import InFlightPolicy, SamplingParams
from services.weight_checks import check_state_dict


def processed_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits (B, V) after temperature, top-k and top-p (dropped tokens at -inf); temperature > 0."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


class RegexMask:
    """Token-level regex constraint for the torch engine: a token may follow only if the text so far, with it,
    can still be extended to a full match (the `regex` package's partial matching); a stop token only on a full match.

    Sampling stays exact: the candidates are ranked by Gumbel-max keys over the temperature/top-k/top-p distribution,
    and the first allowed one is a draw from that distribution restricted to the allowed tokens. When no token of the
    nucleus is allowed, the rest are tried by raw logit, up to `limit` checks; past that the sample ends ("length").
    """

    def __init__(self, pattern: str, tokenizer, stop_ids: set[int], limit: int = 4096):
        import regex

        self.pattern, self.tok, self.stop_ids, self.limit = regex.compile(pattern), tokenizer, stop_ids, limit

    def allowed(self, ids: list[int], token: int) -> bool:
        if token in self.stop_ids:
            return self.pattern.fullmatch(self.tok.decode(ids, skip_special_tokens=True)) is not None
        return (
            self.pattern.fullmatch(self.tok.decode(ids + [token], skip_special_tokens=True), partial=True) is not None
        )

    def pick(self, ids: list[int], raw: torch.Tensor, proc: torch.Tensor | None, gen: torch.Generator) -> int | None:
        """The next token for one row (its (V,) raw logits, and processed ones unless greedy), or None at a dead end."""

        def ranked():
            if proc is not None:
                keys = proc - torch.log(
                    -torch.log(torch.rand(proc.shape, generator=gen, device=proc.device).clamp_min(1e-20))
                )
                yield from keys.argsort(descending=True)[: int(torch.isfinite(proc).sum())].tolist()
            # only reached when the nucleus has no allowed token
            yield from raw.argsort(descending=True)[: self.limit].tolist()

        tried = set()
        for token in ranked():
            if token in tried:
                continue
            tried.add(token)
            if self.allowed(ids, token):
                return token
            if len(tried) >= self.limit:
                break
        return None


def text_hits_stop(tokenizer, ids: list[int], stops: list[str]) -> bool:
    """Whether the text of `ids` now holds a stop string. Only the tail is decoded: a character takes at most 4 tokens
    (its bytes), and a stop string found earlier would have ended the sample then."""
    window = 4 * max(map(len, stops)) + 8
    tail = tokenizer.decode(ids[-window:], skip_special_tokens=True)
    return any(s in tail for s in stops)


@ENGINES.register("torch")
class TorchEngine(Engine):
    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "float32", threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device).eval()
        )
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = set(eos) | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.weight_version = 0
        self._lock = threading.Lock()  # one generate or weight update at a time
        self._admit = threading.Event()
        self._admit.set()
        self._abort_epoch = 0  # bumped by abort() and by an "abort" commit: generate calls compare at each token
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._commit: InFlightPolicy | None = None  # the policy of a commit waiting to be applied
        self.generated_tokens = 0
        self._busy = False

    # lifecycle -------------------------------------------------------------
    def pause(self) -> None:
        self._admit.clear()

    def resume(self) -> None:
        self._admit.set()

    def abort(self) -> None:
        self._abort_epoch += 1

    @property
    def paused(self) -> bool:
        return not self._admit.is_set()

    @property
    def busy(self) -> bool:
        return self._busy

    def vocab_size(self) -> int:
        return max(len(self.tokenizer), self.model.config.vocab_size)

    def health_token_id(self) -> int:
        return self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.pad_id

    def context_length(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def score(self, sequences: list[list[int]], top_k: int) -> list[ScoredTokens]:
        """One forward pass per sequence, under the lock, on the weights being served."""
        out = []
        with self._lock, torch.inference_mode():
            for ids in sequences:
                x = torch.tensor([ids], dtype=torch.long, device=self.device)
                logp = torch.log_softmax(self.model(input_ids=x).logits[0, :-1].float(), -1)  # position j predicts j+1
                chosen = logp.gather(-1, x[0, 1:, None]).squeeze(-1).tolist()
                top = torch.topk(logp, top_k, -1) if top_k else None
                alts = [list(zip(i.tolist(), v.tolist())) for v, i in zip(*top)] if top else [[] for _ in chosen]
                out.append(ScoredTokens([None, *chosen], [[], *alts]))
        return out

    # weights ---------------------------------------------------------------
    def weight_spec(self) -> dict[str, tuple[list[int], str]]:
        return spec_of(canonical_state_dict(self.model))

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        problems = check_state_dict(self.weight_spec(), spec_of(state_dict)) + non_finite(state_dict)
        if version <= self.weight_version:
            problems.append(f"version {version} is not newer than the served version {self.weight_version}")
        if problems:
            raise WeightsRejected("; ".join(problems))
        self._staged = (version, {n: t.to(self.device) for n, t in state_dict.items()})

    def commit_weights(self, version: int, policy: InFlightPolicy | None = "finish") -> None:
        # already served: a replica's catch-up and the push's own commit can both land
        if version <= self.weight_version:
            return
        if self._staged is None or self._staged[0] != version:
            raise WeightsRejected(f"version {version} is not staged on this replica")
        if policy is not None or self._commit is None:  # a catch-up (None) does not override a push's policy
            self._commit = policy or "finish"
        if policy == "abort":
            self._abort_epoch += 1
        # "partial": the running generate call applies it at its next token
        while not self._lock.acquire(timeout=0.005):
            if self.weight_version >= version:
                return
        try:
            self._apply_staged()
        finally:
            self._lock.release()

    def discard_weights(self, version: int) -> None:
        if self._staged is not None and self._staged[0] == version:
            self._staged = None

    def _apply_staged(self) -> None:
        """Copy the staged tensors into the model; the caller holds self._lock."""
        if self._staged is None or self._commit is None:
            return
        version, tensors = self._staged
        with torch.no_grad():
            params = canonical_state_dict(self.model)
            for name, t in tensors.items():
                params[name].copy_(t)
        self.weight_version, self._staged, self._commit = version, None, None

    # generation ------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, cancel: threading.Event | None = None
    ) -> list[EngineOutput]:
        cancel = cancel or threading.Event()
        while not self._admit.wait(0.05):
            if cancel.is_set():
                return [EngineOutput([], [], "abort", self.weight_version, []) for _ in prompts]
        with self._lock, torch.inference_mode():
            self._apply_staged()  # a commit waiting for the lock goes first: this call is not in flight yet
            self._busy = True
            try:
                return self._generate(prompts, params, cancel)
            finally:
                self._busy = False
                # the commit that cut this call is served before the caller sees its outputs (and reruns them)
                if self._commit == "abort":
                    self._apply_staged()

    def _generate(self, prompts: list[list[int]], p: SamplingParams, cancel: threading.Event) -> list[EngineOutput]:
        B, L, dev = len(prompts), max(map(len, prompts)), self.device
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for i, prompt in enumerate(prompts):  # left padding: every row's next token sits at column L
            ids[i, L - len(prompt) :] = torch.tensor(prompt)
            mask[i, L - len(prompt) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        gen = torch.Generator(device=dev).manual_seed(p.seed if p.seed is not None else random.getrandbits(63))
        stop = torch.tensor(
            sorted((set() if p.ignore_eos else self.eos_ids) | set(p.stop_token_ids)), dtype=torch.long, device=dev
        )
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        lengths = torch.full((B,), p.max_new_tokens, dtype=torch.long)
        toks, lps, slps, versions, past, epoch, aborted = [], [], [], [], None, self._abort_epoch, False
        rx = RegexMask(p.regex, self.tokenizer, set(stop.tolist())) if p.regex else None
        texts: list[list[int]] = [[] for _ in range(B)]  # constrained rows' tokens so far
        said: list[list[int]] = [[] for _ in range(B)]  # each row's tokens so far, when stop strings are asked
        dead = torch.zeros(B, dtype=torch.bool, device=dev)  # constrained rows with no allowed token
        rows = torch.arange(B, device=dev)  # the rows still in the batch: a finished row leaves it, KV cache and all
        step_ids, step_pos = ids, pos
        for t in range(p.max_new_tokens):
            if self._commit == "partial":
                self._apply_staged()
            if self._abort_epoch != epoch or cancel.is_set():
                aborted = True
                lengths[~done.cpu()] = t
                break
            out = self.model(
                input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=past, use_cache=True
            )
            past, logits = out.past_key_values, out.logits[:, -1, :].float()
            proc = None if p.temperature == 0 else processed_logits(logits, p)
            if rx is None:
                live_tok = (
                    logits.argmax(-1)
                    if proc is None
                    else torch.multinomial(torch.softmax(proc, -1), 1, generator=gen).squeeze(-1)
                )
            else:
                picks = [
                    None if done[i] else rx.pick(texts[i], logits[j], None if proc is None else proc[j], gen)
                    for j, i in enumerate(rows.tolist())
                ]
                for i, pick in zip(rows.tolist(), picks):
                    if pick is None and not done[i]:  # a dead end: the row ends before this token
                        dead[i], done[i], lengths[i] = True, True, t
                    elif pick is not None:
                        texts[i].append(pick)
                live_tok = torch.tensor([self.pad_id if x is None else x for x in picks], dtype=torch.long, device=dev)
            tok, lp, slp = (
                torch.full((B,), self.pad_id, dtype=torch.long, device=dev),
                torch.zeros(B, device=dev),
                torch.zeros(B, device=dev),
            )
            tok[rows] = live_tok
            lp[rows] = torch.log_softmax(logits, -1).gather(-1, live_tok[:, None]).squeeze(-1)
            if proc is not None:
                slp[rows] = torch.log_softmax(proc, -1).gather(-1, live_tok[:, None]).squeeze(-1)
            toks.append(tok)
            lps.append(lp)
            slps.append(slp)
            versions.append(self.weight_version)
            finished = ~done & torch.isin(tok, stop)
            for i in rows.tolist() if p.stop else ():  # stop strings: the live rows' text so far
                said[i].append(int(tok[i]))
                finished[i] |= not bool(done[i]) and text_hits_stop(self.tokenizer, said[i], p.stop)
            lengths[finished.cpu()] = t + 1
            done |= finished
            if bool(done.all()):
                break
            keep = self._rows_to_keep(done, rows)
            step_ids, step_pos = live_tok[keep, None], step_pos[keep, -1:] + 1
            mask = torch.cat([mask[keep], torch.ones((int(keep.sum()), 1), dtype=mask.dtype, device=dev)], dim=1)
            if not bool(keep.all()):
                past.reorder_cache(keep.nonzero().squeeze(-1))
                rows = rows[keep]
        tok_mat = torch.stack(toks, 1).tolist() if toks else [[] for _ in range(B)]
        lp_mat = torch.stack(lps, 1).tolist() if lps else [[] for _ in range(B)]
        slp_mat = torch.stack(slps, 1).tolist() if slps else [[] for _ in range(B)]
        outs = []
        for i in range(B):
            n = int(lengths[i])
            reason = (
                "stop"
                if bool(done[i]) and not bool(dead[i])
                else ("abort" if aborted and not bool(dead[i]) else "length")
            )
            outs.append(
                EngineOutput(
                    tok_mat[i][:n],
                    lp_mat[i][:n],
                    reason,
                    versions[0] if n else self.weight_version,
                    versions[:n],
                    slp_mat[i][:n],
                )
            )
        self.generated_tokens += sum(len(o.token_ids) for o in outs)
        return outs

    @staticmethod
    def _rows_to_keep(done: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Which of the batch's live rows stay for the next step: the unfinished ones (a finished row leaves the
        batch and its KV cache)."""
        return ~done[rows]
