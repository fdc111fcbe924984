#!/usr/bin/env bash
# The trainer's two recoveries, shown with real processes against a real service (arith-tiny; about 3 min on 2 cores):
#   1. crash-resume: `farm train` is killed with SIGKILL after its third checkpoint; the same command again
#      resumes from that checkpoint and finishes the run.
#   2. rollback: the design preset (6 PPO epochs a step) with kl_rollback lowered to 0.02, so that the KL guard trips
#      within a few steps: pause sampling, restore the last checkpoint, push it as a new version, resume.
# Logs and runs go to runs/recovery/. Run from the repository root after `make install`:
#     bash bench/recovery_demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
farm=.venv/bin/farm
out=runs/recovery
rm -rf "$out" && mkdir -p "$out"
read -r port metrics_port < <(.venv/bin/python -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
export FARM_API_TOKEN=recovery-demo-token FARM_URL=http://127.0.0.1:$port

$farm serve --model arith-tiny --port "$port" > "$out/service.log" 2>&1 &
service=$!
trap 'kill -TERM $service 2>/dev/null; wait $service 2>/dev/null || true' EXIT
until curl -sf "$FARM_URL/readyz" > /dev/null; do
  kill -0 $service 2>/dev/null || { echo "the service did not start; see $out/service.log"; exit 1; }
  sleep 1
done
echo "== service up on $FARM_URL, serving version $($farm weights version | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["version"])')"

echo; echo "== 1. crash-resume"
train=($farm train --service-url "$FARM_URL" --model arith-tiny --steps 8 --out "$out/resume" trainer.save_freq=1)
echo "\$ ${train[*]} &"
"${train[@]}" > "$out/resume-killed.log" 2>&1 &
trainer=$!
until [ -e "$out/resume/checkpoints/step_3" ]; do
  kill -0 $trainer 2>/dev/null || { echo "the trainer ended before its third checkpoint; see $out/resume-killed.log"; exit 1; }
  sleep 0.2
done
kill -KILL $trainer; wait $trainer 2>/dev/null || true
echo "killed with SIGKILL; latest checkpoint: $(cat "$out/resume/checkpoints/latest"), steps logged: $(.venv/bin/python -c '
import json, sys; print([json.loads(l)["step"] for l in open(sys.argv[1])])' "$out/resume/metrics.jsonl")"
echo "\$ ${train[*]}   # the same command again"
"${train[@]}" > "$out/resume-again.log" 2>&1
grep '"resumed"' "$out/resume-again.log"
.venv/bin/python - "$out/resume/metrics.jsonl" "$out/resume/summary.json" <<'PY'
import json, sys
steps = [json.loads(line) for line in open(sys.argv[1])]
print("steps logged:", [s["step"] for s in steps], "weight versions:", [s["weight_version"] for s in steps])
print("final weight version:", json.load(open(sys.argv[2]))["final_weight_version"])
PY

echo; echo "== 2. KL guard rollback"
rollback=($farm train --config rollout_farm/trainer/presets/design.yaml --service-url "$FARM_URL" --model arith-tiny --task arith --steps 8
          --out "$out/rollback" --lr 3e-5 data.train_batch_size=16 data.max_response_length=24 actor_rollout_ref.actor.ppo_mini_batch_size=16
          guards.kl_rollback=0.02 trainer.save_freq=2 trainer.metrics_port=$metrics_port)
echo "\$ ${rollback[*]}"
"${rollback[@]}" > "$out/rollback.log" 2>&1 &
trainer=$!
actions=""
while kill -0 $trainer 2>/dev/null; do  # the trainer's Prometheus counter, read while it runs
  actions=$(curl -sf "http://127.0.0.1:$metrics_port/metrics" | grep '^farm_trainer_guard_actions_total' || echo "$actions")
  sleep 1
done
wait $trainer || { echo "the trainer failed; see $out/rollback.log"; tail -5 "$out/rollback.log"; exit 1; }
grep '"guard_action"' "$out/rollback.log" || { echo "no guard action: the KL never passed 0.02"; exit 1; }
echo "trainer metrics, last scrape while it ran: ${actions//$'\n'/; }"
.venv/bin/python - "$out/rollback/metrics.jsonl" <<'PY'
import json, sys
for s in map(json.loads, open(sys.argv[1])):
    print(f"step {s['step']}: kl_ref {s['kl_ref']:.4f}  weight_version {s['weight_version']}  guard_actions {s['guard_actions']}")
PY
echo "service: $($farm weights version)"
