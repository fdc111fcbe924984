"""The trajectory queue's Redis layout (rollout_farm/services/queue/trajectory_queue.py uses it): each source's keys,
the Lua scripts that add prompts and settle entries atomically, and the JSON entries of prompts.

Keys of a source, under farm:<app>:q:<name>:
  pending     list: prompts to generate, each JSON {"pid", "prompt"}; stale groups' prompts return to the front
  generating  list: prompts the owner is generating now; back to the front of pending if the owner dies
  ready       stream, one entry per group, read by the consumer group "trainers": XREADGROUP delivers an entry
              (it joins the group's pending entries list, the PEL), XACK settles it, XCLAIM delivers it again
  leases      zset: entry id -> lease deadline (ms, Redis clock)
  deliveries  hash: entry id -> times delivered
  acked       set: acked item_ids (acking again changes nothing)
  dropped     hash: item_id -> prompt JSON, for delivered groups later dropped as stale
  withdrawn   set: pids whose regeneration a late ack withdrew (skipped when they land or are first pulled)
  stats       hash: redelivered, stale_dropped, error; drawn (dataset prompts taken so far); pids (last pid);
              busy_s, idle_s (seconds the generation loop spent generating / with nothing it was allowed to do)
  batches     set: the batch_ids of prompt additions (a repeated addition with the same batch_id adds nothing)
  settled     hash: pid -> groups of that prompt acked (1 each; bench/chaos.py audits it)
  owner       the generating replica's claim (rollout_farm/services/state/redis_client.py Owner)
"""

from __future__ import annotations

import itertools
import json
import random

from rollout_farm.services import protocol as P
from rollout_farm.services.extensions.tasks import TASKS

GROUP = "trainers"  # the consumer group of every source's stream

ACK = """
if redis.call('sismember', KEYS[4], ARGV[1]) == 1 then return 2 end
local entry = redis.call('xrange', KEYS[1], ARGV[2], ARGV[2])[1]
if entry and redis.call('xack', KEYS[1], 'trainers', ARGV[2]) == 1 then
  local fields, pid = entry[2], nil
  for i = 1, #fields, 2 do if fields[i] == 'entry' then pid = cjson.decode(fields[i + 1])['pid'] end end
  redis.call('xdel', KEYS[1], ARGV[2]); redis.call('zrem', KEYS[2], ARGV[2]); redis.call('hdel', KEYS[3], ARGV[2])
  redis.call('sadd', KEYS[4], ARGV[1]); redis.call('hincrby', KEYS[8], tostring(pid), 1); return 1
end
local prompt = redis.call('hget', KEYS[5], ARGV[1])
if prompt then
  local pid = tostring(cjson.decode(prompt)['pid'])
  redis.call('hdel', KEYS[5], ARGV[1]); redis.call('sadd', KEYS[4], ARGV[1]); redis.call('hincrby', KEYS[8], pid, 1)
  if redis.call('lrem', KEYS[6], 1, prompt) == 0 then redis.call('sadd', KEYS[7], pid) end
  return 1
end
return 0
"""  # KEYS: ready leases deliveries acked dropped pending withdrawn settled; ARGV: item_id entry_id -> 1, 2 again, 0

DROP = """
if redis.call('xack', KEYS[1], 'trainers', ARGV[1]) == 0 then return 0 end
redis.call('xdel', KEYS[1], ARGV[1]); redis.call('zrem', KEYS[2], ARGV[1]); redis.call('hdel', KEYS[3], ARGV[1])
if ARGV[4] == 'withdrawn' then redis.call('srem', KEYS[7], ARGV[5]); return 1 end
redis.call('lpush', KEYS[4], ARGV[3])
if ARGV[4] == 'delivered' then redis.call('hset', KEYS[5], ARGV[2], ARGV[3]) end
redis.call('hincrby', KEYS[6], 'stale_dropped', 1)
return 1
"""  # KEYS: ready leases deliveries pending dropped stats withdrawn; ARGV: entry_id item_id prompt how pid


ADD = """
if ARGV[1] ~= '' and redis.call('sadd', KEYS[2], ARGV[1]) == 0 then return 0 end
local last = redis.call('hincrby', KEYS[3], 'pids', #ARGV - 1)
for i = 2, #ARGV do
  redis.call('rpush', KEYS[1], '{"pid": ' .. (last - #ARGV + i) .. ', "prompt": ' .. ARGV[i] .. '}')
end
return 1
"""  # KEYS: pending batches stats; ARGV: batch_id ('' for none), each prompt's JSON -> 0 when the batch came before
# (the entries are what prompt_entries() writes; pids are taken here, so a batch added before takes none)


class Keys:
    def __init__(self, prefix: str, name: str):
        base = f"{prefix}:q:{name}"
        self.pending, self.generating, self.ready = f"{base}:pending", f"{base}:generating", f"{base}:ready"
        self.leases, self.deliveries, self.acked = f"{base}:leases", f"{base}:deliveries", f"{base}:acked"
        self.dropped, self.withdrawn, self.stats = f"{base}:dropped", f"{base}:withdrawn", f"{base}:stats"
        self.owner, self.batches, self.settled = f"{base}:owner", f"{base}:batches", f"{base}:settled"

    def all(self) -> list[str]:
        return list(vars(self).values())


def dataset_prompts(spec: P.QueueSource, skip: int):
    """The dataset's prompts in the source's order, from the `skip`-th on (endless)."""
    task, rng = TASKS.get(spec.dataset)(), random.Random(spec.seed)
    endless = (p for _ in itertools.count() for p in task.train_batch(rng, 64))
    for problem in itertools.islice(endless, skip, None):
        yield P.Prompt(text=problem.prompt, ground_truth=problem.answer)


def prompt_entries(prompts: list[P.Prompt], last_pid: int) -> list[str]:
    """The JSON entries of prompts whose pids end at last_pid (a pid tells a prompt's generations apart)."""
    first = last_pid - len(prompts) + 1
    return [json.dumps({"pid": first + i, "prompt": p.model_dump(mode="json")}) for i, p in enumerate(prompts)]
