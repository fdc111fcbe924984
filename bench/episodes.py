"""GRPO over calculator episodes against single-turn GRPO on the same budget (issue 26), on products the tiny
model cannot work out in its head: `Q: 347*2918\\nA:` (rollout_farm/services/extensions/tasks.py `products`).

The model, `arith-tool`, is the embedded default's recipe (a 1.1M-parameter byte-level Llama) pretrained on a corpus
that is half the arithmetic task and half products. TOOL_SHARE of the products are written as a calculator episode
(the call, the farm's observation, the answer), the rest as a direct answer it can only guess. The episodes' tokens
are rendered exactly as a session renders them (rollout_farm/services/chat/delta.py), so pretraining and the
farm agree on every token. Greedy decoding takes the majority, a direct answer, so it starts near zero on products.

Two arms, --seeds seeds each; run k of both arms has trainer.seed=k (the same prompts in the same order and the
same sampling seeds), so the comparison pairs by seed:
  episodes     data.env=calculator: every sample is an episode of up to 3 turns, trained on its sampled tokens
  single_turn  plain rollouts of the same prompts: the model can write a call, but nothing runs it
Each trains --steps steps of 16 prompts x 8 samples. Before training and after each run, the held-out products
(--eval-size, greedy) are scored two ways: as calculator episodes (accuracy and tool-call rate), and single-turn.

Each (arm, seed) run writes docs/data/episodes/<arm>-seed<k>.json (and the model before training, before.json); a
finished file is skipped on a re-run (--force runs it again). --report rebuilds docs/results.md's section between
its markers from the files alone (scipy: `pip install -c requirements.lock -e '.[bench]'`).

    .venv/bin/python bench/episodes.py            # about 20 min on 2 cores; resumable
    .venv/bin/python bench/episodes.py --report   # seconds
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import (  # noqa: E402
    ROOT,
    TOKEN,
    PairedRuns,
    fresh_folder,
    log,
    provenance,
    shown_path,
    train_run,
    train_steps,
    write_record,
)
from rollout_farm.services import protocol as P  # noqa: E402
from rollout_farm.services.chat.delta import opening, turn_context  # noqa: E402
from rollout_farm.services.chat.tool_formats import TOOL_FORMATS, ToolCall  # noqa: E402
from rollout_farm.services.client import FarmClient  # noqa: E402
from rollout_farm.services.episodes.calculator import CALCULATOR_TOOL, Calculator  # noqa: E402
from rollout_farm.services.extensions.tasks import ArithTask, ProductsTask  # noqa: E402
from rollout_farm.services.models import CACHE, EOS, Piece, byte_tokenizer, default_corpus, pretrain  # noqa: E402
from rollout_farm.services.protocol import episodes as E  # noqa: E402

DATA = ROOT / "docs" / "data" / "episodes"
RESULTS = ROOT / "docs" / "results.md"
BEGIN, END = "<!-- episodes:begin -->", "<!-- episodes:end -->"
TOOL_SHARE = 0.15  # of the products in pretraining, written as calculator episodes
PRODUCT_SHARE = 0.5  # of the pretraining corpus; the rest is the embedded task's
MODEL = CACHE / "models" / f"arith-tool-v1-{TOOL_SHARE}"
MAX_TURNS = 3
SHARED = [
    f"actor_rollout_ref.model.path={MODEL}",
    "trainer.task=products",
    "data.train_batch_size=16",
    "actor_rollout_ref.rollout.n=8",
]
ARMS = {"episodes": ["data.env=calculator", f"data.max_turns={MAX_TURNS}"], "single_turn": []}
CALCULATOR = E.EnvSpec(name="calculator")


# the model --------------------------------------------------------------------------------------------------------
class ToolCorpus:
    """Pretraining examples: the embedded task's, and products either answered directly or through the calculator,
    the episode's context rendered by the session's own code."""

    def __init__(self):
        self.tok, self.tools, self.format = byte_tokenizer(), [CALCULATOR_TOOL], TOOL_FORMATS.get("plain")()
        self.arith, self.products = ArithTask(), ProductsTask()

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids)  # byte-level: decoding and encoding again give the same ids

    def episode(self, prompt: str, expression: str) -> list[Piece]:
        """A calculator episode as the farm holds it: the opening, the call, the observation, the answer."""
        first = opening(self.tok, [{"role": "user", "content": prompt}], self.tools)
        call = ToolCall("call_0_0", "calculator", json.dumps({"expression": expression}))
        result = Calculator.answer(call)
        sampled = " " + self.format.render_call("calculator", {"expression": expression})
        held = self.tok.encode(prompt + sampled, add_special_tokens=False) + [self.tok.eos_token_id]
        observation = [{"role": "tool", "tool_call_id": call.id, "content": result}]
        context = turn_context(self.tok, held, True, observation, self.tools, False)
        return [
            (self.text(first.messages + first.prompt), False),
            (sampled, True),
            (EOS, True),
            (self.text([t for piece in context for t in piece]), False),
            (f" #### {result.removeprefix('= ')}", True),
            (EOS, True),
        ]

    def __call__(self, rng: random.Random) -> list[Piece]:
        if rng.random() >= PRODUCT_SHARE:
            return default_corpus(rng, self.arith)
        p = self.products.train_batch(rng, 1)[0]
        if rng.random() < TOOL_SHARE:
            return self.episode(p.prompt, p.prompt.removeprefix("Q: ").removesuffix("\nA:"))
        return [(p.prompt, False), (f" #### {p.answer}", True), (EOS, True)]


def tool_model() -> Path:
    if not (MODEL / "done").exists():
        pretrain(MODEL, ToolCorpus(), steps=600, what="arith-tool")
    return MODEL


# scoring ------------------------------------------------------------------------------------------------------------
def score(client: FarmClient, size: int) -> dict:
    """Greedy on the held-out products: as calculator episodes (correct, called the tool) and single-turn."""
    problems = ProductsTask().heldout(size)
    prompts = [P.Prompt(text=p.prompt, ground_truth=p.answer) for p in problems]
    greedy = P.SamplingParams(temperature=0.0, max_new_tokens=ProductsTask.max_new_tokens)
    episodes = client.episodes(
        E.EpisodeRequest(env=CALCULATOR, prompts=prompts, n=1, sampling_params=greedy, max_turns=MAX_TURNS)
    ).groups
    single = client.rollouts(P.RolloutRequest(prompts=prompts, n=1, sampling_params=greedy, reward="gsm8k")).groups
    runs = [g.episodes[0] for g in episodes]
    return {
        "episode_accuracy": statistics.fmean(e.reward > 0.5 for e in runs),
        "tool_call_rate": statistics.fmean(e.tool_calls > 0 for e in runs),
        "single_turn_accuracy": statistics.fmean(g.samples[0].reward > 0.5 for g in single),
        "stop_reasons": dict(sorted(_count(e.stop_reason for e in runs).items())),
        "example": byte_tokenizer().decode(runs[0].segments[0].token_ids),  # the first episode, as the model saw it
    }


def _count(xs) -> dict:
    out: dict = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return out


# runs -------------------------------------------------------------------------------------------------------------
def settings(a) -> dict:
    return {"steps": a.steps, "eval_size": a.eval_size, "tool_share": TOOL_SHARE}


def train_one(url: str, arm: str, seed: int, a) -> dict:
    folder = fresh_folder("bench-episodes", f"{arm}-seed{seed}")
    overrides = [*SHARED, *ARMS[arm]]
    t = time.perf_counter()
    train_run(url, seed, folder, [*overrides, f"trainer.total_training_steps={a.steps}"])
    wall = time.perf_counter() - t
    rewards = [round(s["reward_mean"], 4) for s in train_steps(folder)]
    after = score(FarmClient(url, token=TOKEN), a.eval_size)  # the service holds the run's last weights
    return {
        "arm": arm,
        "seed": seed,
        "overrides": overrides,
        "settings": settings(a),
        "wall_s": round(wall, 1),
        **provenance(),
        "reward_mean_per_step": rewards,
        "after": after,
    }


def run(a) -> None:
    runs = PairedRuns(a.data_dir, list(ARMS), a.seeds, a.force, lambda arm: {"settings": settings(a)})
    todo, before = runs.todo(), a.data_dir / "before.json"
    if not todo and before.exists() and not a.force:
        log(f"every run has its file in {a.data_dir}; --force runs them again")
        return

    def score_before(url: str) -> None:
        if a.force or not before.exists():
            write_record(
                before,
                {"settings": settings(a), **provenance(), "score": score(FarmClient(url, token=TOKEN), a.eval_size)},
            )

    runs.run(
        todo,
        str(tool_model()),
        lambda url, arm, seed: train_one(url, arm, seed, a),
        "episodes bench",
        note=lambda record: f", after {record['after']}",
        before=score_before,
    )
    log("now: .venv/bin/python bench/episodes.py --report")


# the report -------------------------------------------------------------------------------------------------------
def report(data_dir: Path) -> str:
    from bench.claims_stats import judge

    before = json.loads((data_dir / "before.json").read_text())
    runs = {arm: {} for arm in ARMS}
    for path in sorted(data_dir.glob("*-seed*.json")):
        r = json.loads(path.read_text())
        runs[r["arm"]][r["seed"]] = r
    seeds = sorted(set(runs["episodes"]) & set(runs["single_turn"]))
    keys = ("episode_accuracy", "tool_call_rate", "single_turn_accuracy")
    s0 = before["score"]

    def cell(arm: str, key: str) -> str:
        xs = [runs[arm][k]["after"][key] for k in seeds]
        return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0:.3f}"

    any_run = runs["episodes"][seeds[0]]
    lines = [
        f"Data: `{shown_path(data_dir)}/`, one JSON file per arm and seed and `before.json`, written by "
        f"`.venv/bin/python bench/episodes.py --steps {any_run['settings']['steps']} --seeds {len(seeds)}`. Rebuild "
        "this section: `.venv/bin/python bench/episodes.py --report`.",
        f"Commit {', '.join(sorted({runs[a][k]['commit'][:12] for a in ARMS for k in seeds}))}; "
        f"run {any_run['date'][:10]}; {any_run['machine']['cpus']} CPUs, torch {any_run['machine']['torch']}.",
        "",
        f"**Not rerun since:** the figures are the code's at commit "
        f"{', '.join(sorted({runs[a][k]['commit'][:7] for a in ARMS for k in seeds}))}, before the issue-35 "
        "reorganisation and issue 36's trainer changes (the guards before the push; the guards are off in both arms).",
        "",
        f"Both arms: {', '.join(f'`{o}`' for o in SHARED[1:])}, the model `arith-tool` (TOOL_SHARE "
        f"{any_run['settings']['tool_share']} of its pretraining products are calculator episodes), "
        f"{any_run['settings']['steps']} steps; `episodes` adds {', '.join(f'`{o}`' for o in ARMS['episodes'])}. "
        f"Held-out: {any_run['settings']['eval_size']} products, greedy, scored as calculator episodes (up to "
        f"{MAX_TURNS} turns) and single-turn.",
        "",
        "| model | seeds | episode accuracy | tool-call rate | single-turn accuracy |",
        "| --- | --- | --- | --- | --- |",
        f"| before training | — | {s0['episode_accuracy']:.3f} | {s0['tool_call_rate']:.3f} | "
        f"{s0['single_turn_accuracy']:.3f} |",
        *(f"| after `{arm}` | {len(seeds)} | " + " | ".join(cell(arm, k) for k in keys) + " |" for arm in ARMS),
        "",
        "mean ± std over seeds. Per seed (episode accuracy, tool-call rate):",
        "",
        *(
            f"- `{arm}`: "
            + " / ".join(
                f"{runs[arm][k]['after']['episode_accuracy']:.3f}, {runs[arm][k]['after']['tool_call_rate']:.3f}"
                for k in seeds
            )
            for arm in ARMS
        ),
        "",
        "Paired by seed: the effect is `episodes`' figure minus `single_turn`'s after the same steps on the same "
        "prompts; over the seeds, its mean, 95% t interval and paired t-test p (bench/claims_stats.py `judge`; when "
        "every seed gives the same effect, no interval and an exact sign test's p, which cannot go below 0.25 with 3 "
        "seeds). It **holds** if the whole interval lies at or above the claimed size (without an interval: every "
        "seed's effect does) and p < 0.05, **fails** if the whole interval lies below it, else it is **inconclusive**.",
        "",
        "| figure after training | claimed | effect: mean [95% CI] | p | verdict |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key, claimed in (("episode_accuracy", 0.10), ("tool_call_rate", 0.10), ("single_turn_accuracy", None)):
        effects = [runs["episodes"][k]["after"][key] - runs["single_turn"][k]["after"][key] for k in seeds]
        j = judge(effects, claimed)
        p = "—" if j.p != j.p else ("< 0.001" if j.p < 0.001 else f"{j.p:.3f}")
        ci = f" [{j.lo:+.3f}, {j.hi:+.3f}]" if j.lo == j.lo else ""  # none when the seeds agree exactly
        lines.append(
            f"| {key.replace('_', ' ')} | {'+%.2f' % claimed if claimed is not None else '(reported)'} | "
            f"{j.mean:+.3f}{ci} | {p} | {j.verdict and f'**{j.verdict}**' or '—'} |"
        )
    n = any_run["settings"]["eval_size"]
    lines += [
        "",
        f"Per seed, the tool-call rate's exact McNemar test on the same {n} held-out problems (`episodes` calls, "
        "`single_turn` does not : the other way round; two-sided binomial on the discordant problems). The files "
        "keep each arm's rate, not its per-problem calls; the discordant counts follow from the rates exactly when "
        "one arm's rate is 0 or 1, as here. Beside the across-seed test above, whose sign-test p cannot go below 0.25 "
        "with 3 seeds:",
        "",
        *(f"- seed {k}: {tool_call_mcnemar(runs, k, n)}" for k in seeds),
    ]
    return "\n".join(lines)


def tool_call_mcnemar(runs: dict, seed: int, n: int) -> str:
    """The seed's exact McNemar test on the tool-call rate, from the two arms' rates on the same n problems: the
    discordant counts are known when one arm's rate is 0 or 1 (every problem agrees there)."""
    from scipy import stats

    a, b = (round(runs[arm][seed]["after"]["tool_call_rate"] * n) for arm in ("episodes", "single_turn"))
    if a not in (0, n) and b not in (0, n):
        return "n/a (the rates alone do not give the discordant problems)"
    yes_no, no_yes = (n - b, 0) if a == n else (0, b) if a == 0 else (0, n - a) if b == n else (a, 0)
    p = float(stats.binomtest(yes_no, yes_no + no_yes).pvalue) if yes_no + no_yes else 1.0
    return f"{yes_no} : {no_yes}, p = {p:.2g}"


def replace_section(text: str) -> None:
    md = RESULTS.read_text()
    head, _, rest = md.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not rest:
        sys.exit(f"{RESULTS} has no {BEGIN} ... {END} markers")
    RESULTS.write_text(f"{head}{BEGIN}\n<!-- generated by bench/episodes.py --report -->\n\n{text}\n{END}{tail}")
    log(f"rewrote the episodes section of {RESULTS.relative_to(ROOT)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (trainer.seed)")
    ap.add_argument("--eval-size", type=int, default=200, help="held-out products scored greedily")
    ap.add_argument("--data-dir", type=Path, default=DATA)
    ap.add_argument("--force", action="store_true", help="run again the runs that have a file")
    ap.add_argument("--report", action="store_true", help="only rebuild docs/results.md's section from the files")
    a = ap.parse_args()
    if a.report:
        replace_section(report(a.data_dir))
    else:
        run(a)


if __name__ == "__main__":
    main()
