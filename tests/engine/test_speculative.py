"""Speculative decoding from the farm's history (rollout_farm/services/engine/torch/speculative.py): the drafts History
proposes, and verify(), whose samples, logprobs and sampling logprobs are the plain path's (sampling.draw).

The distribution tests run on an enumerable "model": fixed random logits over V tokens for every context of up to
two generated tokens, so the exact probability of each of the V**3 three-token samples is known. Tens of thousands
of rows decode together, three params sets side by side, each with its own generator; a chi-squared test compares
each set's samples with the exact probabilities.

Seeded: every generator here has a fixed seed, so each chi-squared test gives the same p on every run (an exact rule
passes at p > 0.01 whatever the 1% of seeds that would fail it by chance; the broken rules are rejected at p < 1e-6)."""

import pytest
import torch
from scipy.special import chdtrc

from rollout_farm.services.engine.torch import speculative as torch_speculative
from rollout_farm.services.engine.torch.sampling import Group, draw, processed_rows
from rollout_farm.services.engine.torch.speculative import History, verify

V, T, PAD = 8, 3, 0
PROMPT = [5, 1, 6]
PARAMS = [(0.7, 0, 0.9), (0.7, 3, 1.0), (1.3, 4, 0.8)]  # temperature, top-k, top-p
ROWS = 12_000  # per params set


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: threads cost more than they give (and the suite may share the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def table() -> torch.Tensor:
    """Logits for every context of 0, 1 or 2 tokens: row 0, 1 + a, 1 + V + a * V + b."""
    return torch.randn((1 + V + V * V, V), generator=torch.Generator().manual_seed(7)) * 2.0


def code(full: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """The table row of each row's context: its first `length` tokens of `full` (lengths past 2: row 0, unused)."""
    one, two = 1 + full[:, 0], 1 + V + full[:, 0] * V + full[:, 1]
    return torch.where(length == 0, 0, torch.where(length == 1, one, torch.where(length == 2, two, 0)))


def exact(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The probability of each sample a, b, c (index a * V * V + b * V + c)."""
    n = len(logits)
    p = torch.softmax(
        processed_rows(logits, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p)), -1
    ).double()
    a, b, c = torch.meshgrid(torch.arange(V), torch.arange(V), torch.arange(V), indexing="ij")
    return (p[0, a] * p[1 + a, b] * p[1 + V + a * V + b, c]).reshape(-1)


def history() -> History:
    """Earlier samples of PROMPT: the likeliest path, and unlikely ones (tokens top-p and top-k drop)."""
    h, logits = History(), table()
    first = int(logits[0].argmax())
    second = int(logits[1 + first].argmax())
    h.record(PROMPT, [first, second, int(logits[1 + V + first * V + second].argmax())])
    for seq in ([int(logits[0].argmin()), 2, 3], [first, int(logits[1 + first].argmin()), 7], [4, 4, 4]):
        h.record(PROMPT, seq)
    h.record(PROMPT, [first, second, 1])  # the most recent: drafts follow it
    return h


def sample(rule=verify, seed: int = 0) -> tuple[torch.Tensor, int, int]:
    """ROWS samples for each of PARAMS (rows i * ROWS ...), drafted from history() for a third of the rows, random
    tokens for a third, the least likely token for the rest, with a random k up to what is left; and how many
    draft tokens were accepted, of how many."""
    logits, h = table(), history()
    rng = torch.Generator().manual_seed(seed)
    N = ROWS * len(PARAMS)
    temperature = torch.tensor([p[0] for p in PARAMS]).repeat_interleave(ROWS)
    top_k = torch.tensor([p[1] for p in PARAMS]).repeat_interleave(ROWS)
    top_p = torch.tensor([p[2] for p in PARAMS]).repeat_interleave(ROWS)
    mode = torch.randint(0, 3, (N,), generator=rng)
    gens = [torch.Generator().manual_seed(seed * 10 + i) for i in range(len(PARAMS))]
    full, length, cache = torch.zeros((N, 2 * T), dtype=torch.long), torch.zeros(N, dtype=torch.long), {}
    accepted = drafted = 0
    while bool((length < T).any()):
        rows = (length < T).nonzero().squeeze(-1)
        left = T - length[rows]
        k = (torch.rand(len(rows), generator=rng) * left).long()  # 0 .. left - 1: every drafted position fits
        K = int(k.max())
        draft = torch.randint(0, V, (len(rows), K), generator=rng)
        worst, ctx = torch.zeros_like(draft), full[rows].clone()
        for j in range(K):  # the least likely token after the row's tokens and the worst draft before it
            worst[:, j] = logits[code(ctx, length[rows] + j)].argmin(-1)
            ctx.scatter_(1, length[rows, None] + j, worst[:, j : j + 1])
        draft = torch.where(mode[rows, None] == 2, worst, draft)
        mine = ((mode[rows] == 0) & (k > 0)).nonzero().squeeze(-1)
        so_far, lengths, ks = full[rows[mine]].tolist(), length[rows[mine]].tolist(), k[mine].tolist()
        drafts = []
        for tokens, n, want in zip(so_far, lengths, ks):
            key = (tuple(tokens[:n]), want)
            if key not in cache:
                cache[key] = h.lookup(PROMPT, list(key[0]), want)
            drafts.append(cache[key])
        if drafts:
            k[mine] = torch.tensor([len(d) for d in drafts], dtype=torch.long)
            draft[mine] = torch.tensor([d + [0] * (K - len(d)) for d in drafts], dtype=torch.long)
        ctx = full[rows].clone()
        ctx.scatter_(1, length[rows, None] + torch.arange(K), draft)
        pos = [logits[code(ctx, length[rows] + j)] for j in range(K + 1)]
        owner = rows // ROWS
        groups = [Group((owner == g).nonzero().squeeze(-1).tolist(), gens[g]) for g in range(len(PARAMS))]
        groups = [g for g in groups if g.rows]
        out = rule(torch.stack(pos, 1), draft, k, temperature[rows], top_k[rows], top_p[rows], groups, PAD)
        assert bool((out.n <= left).all())
        accepted, drafted = accepted + int(out.accepted.sum()), drafted + int(k.sum())
        full[rows] = full[rows].scatter(1, length[rows, None] + torch.arange(out.tokens.shape[1]), out.tokens)
        length[rows] += out.n
    return (full[:, 0] * V * V + full[:, 1] * V + full[:, 2]).view(len(PARAMS), ROWS), accepted, drafted


def p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-squared goodness of fit; outcomes expected fewer than 5 times are one bin, an impossible one seen is 0."""
    observed = torch.bincount(samples, minlength=len(probs)).double()
    if bool((observed[probs == 0] > 0).any()):
        return 0.0
    expected = probs * len(samples)
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs - exp)[keep] ** 2 / exp[keep]).sum())
    return float(chdtrc(int(keep.sum()) - 1, stat))


def p_values(samples: torch.Tensor) -> list[float]:
    return [p_value(s, exact(table(), *params)) for s, params in zip(samples, PARAMS)]


def test_speculative_samples_have_the_target_distribution():
    samples, accepted, drafted = sample()
    ps = p_values(samples)
    print("speculative p-values", ps, "accepted", accepted, "of", drafted, "drafts")
    assert min(ps) > 0.01
    assert drafted > ROWS and 0.1 < accepted / drafted < 0.9  # likely drafts and unlikely ones


def test_plain_samples_match_the_exact_probabilities_too():
    def plain(logits, draft, n_draft, temperature, top_k, top_p, groups, pad_id):  # no draft: what draw() does
        return verify(logits[:, :1], draft[:, :0], torch.zeros_like(n_draft), temperature, top_k, top_p, groups, 0)

    ps = p_values(sample(plain, seed=1)[0])
    print("plain p-values", ps)
    assert min(ps) > 0.01


@pytest.mark.parametrize("broken", ["always_accept", "no_residual"])
def test_a_wrong_acceptance_rule_is_caught(monkeypatch, broken):
    if broken == "always_accept":
        monkeypatch.setattr(torch_speculative, "_accepts", lambda u, p: torch.ones_like(u, dtype=torch.bool))
    else:  # accepted with p(x), but the rejected token can be drawn again
        monkeypatch.setattr(torch_speculative, "_residual", lambda probs, draft, rejected: probs)
    ps = p_values(sample()[0])
    print(broken, "p-values", ps)
    assert max(ps) < 1e-6


def test_accepting_a_draft_equal_to_the_plain_sample_is_exact_too_so_it_is_no_negative_control():
    """Draw the plain token at each position; keep going while it equals the draft. With a point-mass draft this is
    the same rule as verify's: the draft is kept with probability p(x), and a rejection draws from p without x."""

    def accept_if_equal(logits, draft, n_draft, temperature, top_k, top_p, groups, pad_id):
        B, K1, _ = logits.shape
        probs = torch.softmax(
            processed_rows(logits.reshape(B * K1, V), *(x.repeat_interleave(K1) for x in (temperature, top_k, top_p))),
            -1,
        )
        y = torch.multinomial(probs, 1, generator=groups[0].gen).view(B, K1)
        same = (y[:, :-1] == draft) & (torch.arange(K1 - 1)[None] < n_draft[:, None])
        n = same.long().cumprod(-1).sum(-1) + 1
        tokens = torch.where(torch.arange(K1)[None] < n[:, None] - 1, torch.cat([draft, y[:, -1:]], 1), y)
        return torch_speculative.Verified(tokens, n, n - 1, None, None, None)

    ps = p_values(sample(accept_if_equal, seed=2)[0])
    print("accept-if-equal p-values", ps)
    assert min(ps) > 0.01


def mixed_params(B: int):
    temperature = torch.tensor([0.0, 0.7, 0.7, 1.0, 1.3])[torch.arange(B) % 5]
    top_k = torch.tensor([0, 0, 5, 0, 20])[torch.arange(B) % 5]
    top_p = torch.tensor([1.0, 0.9, 1.0, 1.0, 0.8])[torch.arange(B) % 5]
    return temperature, top_k, top_p


def groups_of(temperature: torch.Tensor, seed: int) -> list[Group]:
    sampled = (temperature > 0).nonzero().squeeze(-1).tolist()
    half = len(sampled) // 2
    return [
        Group(sampled[:half], torch.Generator().manual_seed(seed)),
        Group(sampled[half:], torch.Generator().manual_seed(seed + 1)),
    ]


def test_logprobs_of_emitted_tokens_equal_the_plain_paths():
    """Drafts are the plain path's own samples at each position; wherever verify emits the same token at the same
    position, its logprob and sampling logprob are draw()'s for it (and the greedy rows emit the plain tokens)."""
    B, K, W = 400, 4, 50
    logits = torch.randn((B, K + 1, W), generator=torch.Generator().manual_seed(3)) * 3
    temperature, top_k, top_p = mixed_params(B)
    rep = [x.repeat_interleave(K + 1) for x in (temperature, top_k, top_p)]
    sampled_rows = [r * (K + 1) + j for r in (temperature > 0).nonzero().squeeze(-1).tolist() for j in range(K + 1)]
    flat_groups = [Group(sampled_rows, torch.Generator().manual_seed(9))]
    plain = draw(logits.view(B * (K + 1), W), *rep, flat_groups, PAD)
    tok, lp, slp = (x.view(B, K + 1) for x in (plain.token, plain.logprob, plain.sampling_logprob))
    n_draft = torch.randint(0, K + 1, (B,), generator=torch.Generator().manual_seed(4))
    out = verify(logits, tok[:, :K], n_draft, temperature, top_k, top_p, groups_of(temperature, 5), PAD)
    emitted = torch.arange(K + 1)[None] < out.n[:, None]
    same = emitted & (out.tokens == tok)
    assert int(same.sum()) > B  # most accepted drafts, some corrections
    assert torch.allclose(out.logprob[same], lp[same], atol=1e-5)
    assert torch.allclose(out.sampling_logprob[same], slp[same], atol=1e-5)
    greedy = temperature == 0
    assert bool((out.accepted[greedy] == n_draft[greedy]).all())
    assert bool((same[greedy] == emitted[greedy]).all())
    assert bool((out.sampling_logprob[greedy] == 0).all())
    assert bool((out.tokens[~emitted] == PAD).all()) and bool((out.logprob[~emitted] == 0).all())


def test_greedy_rows_accept_while_the_draft_is_the_argmax():
    logits = torch.randn((3, 4, 10), generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1)
    draft = best[:, :3].clone()
    draft[0, 1] = (draft[0, 1] + 1) % 10  # row 0: wrong at 1; row 1: right; row 2: right, only 1 drafted
    out = verify(logits, draft, torch.tensor([3, 3, 1]), torch.zeros(3), torch.zeros(3, dtype=torch.long),
                 torch.ones(3), [], PAD)  # fmt: skip
    assert out.accepted.tolist() == [1, 3, 1] and out.n.tolist() == [2, 4, 2]
    assert out.tokens[0, :2].tolist() == best[0, :2].tolist()
    assert out.tokens[1].tolist() == best[1].tolist()
    assert out.tokens[2, :2].tolist() == best[2, :2].tolist() and out.tokens[2, 2:].tolist() == [PAD, PAD]


def test_with_no_drafts_a_seeded_group_draws_exactly_what_draw_draws():
    B, W = 64, 30
    logits = torch.randn((B, W), generator=torch.Generator().manual_seed(1)) * 2
    temperature, top_k, top_p = mixed_params(B)
    plain = draw(logits, temperature, top_k, top_p, groups_of(temperature, 11), PAD)
    none = torch.zeros(B, dtype=torch.long)
    out = verify(logits[:, None], none[:, None][:, :0], none, temperature, top_k, top_p, groups_of(temperature, 11), 0)
    assert out.tokens[:, 0].tolist() == plain.token.tolist() and bool((out.n == 1).all())
    assert torch.allclose(out.logprob[:, 0], plain.logprob, atol=1e-5)
    assert torch.allclose(out.sampling_logprob[:, 0], plain.sampling_logprob, atol=1e-5)


def test_regex_rows_pick_their_token_and_one_with_no_allowed_token_ends_before_it():
    class Fixed:
        def __init__(self, token):
            self.token = token

        def pick(self, ids, raw, proc, gen):
            return self.token

    logits = torch.randn((3, 1, 6), generator=torch.Generator().manual_seed(2))
    off, one = torch.zeros(3, dtype=torch.long), torch.ones(3)
    groups = [Group([1], torch.Generator(), Fixed(None)), Group([2], torch.Generator(), Fixed(5))]
    for g in groups:
        g.texts = [[1, 2]]
    for temperature in (torch.tensor([0.0, 0.7, 0.0]), torch.zeros(3)):  # greedy regex rows too, all greedy or not
        out = verify(logits, off[:, None][:, :0], off, temperature, off, one, groups, PAD)
        assert out.dead.tolist() == [False, True, False] and out.n.tolist() == [1, 0, 1]
        assert out.tokens[:, 0].tolist() == [int(logits[0, 0].argmax()), PAD, 5]


# History


def test_history_proposes_what_followed_the_longest_matching_suffix():
    h = History(min_ngram=2, max_ngram=4)
    h.record([9, 9], [1, 2, 3, 4, 5, 6])
    h.record([9, 9], [7, 2, 3, 8, 8])  # more recent, but matches "1 2 3" on "2 3" only
    assert h.lookup([9, 9], [1, 2, 3], 2) == [4, 5]  # the longer match wins
    assert h.lookup([9, 9], [0, 2, 3], 5) == [8, 8]  # equal length: the most recent, as much as it has
    assert h.lookup([9, 9], [1, 2, 3], 0) == []
    assert h.lookup([9, 9], [1], 3) == [2, 3, 4]  # the prompt's tail counts: "9 1" is how the first sample began
    assert h.lookup([9, 9], [], 3) == [7, 2, 3]  # the prompt alone: how the most recent sample began
    assert h.lookup([9, 8], [1, 2], 3) == []  # another prompt
    assert h.lookup([9, 9], [4, 4], 3) == []  # never seen


def test_history_drafts_from_running_siblings_and_the_rows_own_text():
    h = History()
    a, b = h.open([3, 3]), h.open([3, 3])
    h.extend(a, [10, 11, 12, 13])
    assert h.propose(b, 3) == [10, 11, 12]  # b has nothing yet: the prompt's tail matches a's start
    h.extend(b, [10, 11])
    assert h.propose(b, 3) == [12, 13]
    h.extend(a, [20, 21, 22, 20, 21])
    assert h.propose(a, 2) == [22, 20]  # a's own text repeats
    h.close(a)
    h.close(b, keep=False)  # aborted: forgotten
    assert h.lookup([3, 3], [10, 11], 3) == [12, 13, 20]
    assert not h.rows and list(h.prompts[hash((3, 3))].seqs) == [a]


def test_running_siblings_at_the_same_place_do_not_hide_the_history():
    """A GRPO group's rows stand at the same n-gram at once: with nothing after it yet they offer no draft, and a
    proposal must reach the finished sequences behind them (it looks at max_candidates occurrences only)."""
    h = History(max_candidates=4)
    h.record([1, 2, 3], [7, 8, 9])
    rows = [h.open([1, 2, 3]) for _ in range(32)]
    for r in rows:
        h.extend(r, [7])
    assert h.propose(rows[0], 2) == [8, 9]


def test_history_memory_is_bounded():
    h = History(max_prompts=2, per_prompt=2)
    for i in range(3):
        h.record([1, 1], [i, i + 10, i + 20])
    assert len(h.prompts[hash((1, 1))].done) == 2
    assert h.lookup([1, 1], [], 3) == [2, 12, 22] and h.lookup([1, 1], [0], 2) == []  # the oldest is forgotten
    h.record([2, 2], [5, 6])
    running = h.open([3, 3])
    h.record([4, 4], [7, 8])  # past two prompts: the least recently used without a running row go
    assert set(h.prompts) == {hash((3, 3)), hash((4, 4))}
    h.close(running)
    small = History(max_bytes=40 * torch_speculative.BYTES_PER_TOKEN)
    for i in range(20):
        small.record([i], list(range(10)))
    assert small.bytes <= 40 * torch_speculative.BYTES_PER_TOKEN and len(small.prompts) == 3
    assert small.lookup([19], [0, 1], 2) == [2, 3] and small.lookup([0], [0, 1], 2) == []
    many = History(per_prompt=3)
    for i in range(100):  # dropped sequences' chains are let go as they pile up
        many.record([0], [i, 1000 + i, 2000 + i])
    p = many.prompts[hash((0,))]
    assert p.tokens == many.tokens <= 2 * 3 * 4 + 4 and len(p.chains) <= 2 * 3 + 1 and len(p.head) <= 2 * 3 * 3 + 3
    assert many.lookup([0], [99], 2) == [1099, 2099] and many.lookup([0], [98, 1098], 1) == [2098]
