"""The script a worker appends a streaming request's token deltas with (`RedisQueue.publish_deltas`)."""

from shared.records import TERMINAL_LUA

# KEYS[1] a request's delta stream, KEYS[2] its record (the same slot); ARGV the delta, the ttl ms (the result's),
# the margin ms, its "done" channel, the message (the delta itself: a follower needs no read), '1' on its first delta.
# The stream lives as long as the record can (the record's TTL now, which runs to the request's deadline plus the
# result TTL, plus the margin: a finish by the deadline, or an expiry within the grace after it, sets the result TTL
# again from then), so a caller resuming with Last-Event-ID never finds the record without its deltas. The TTL is set
# on the first delta, and on a later one that found no stream (a Redis restarted without persistence: the stream it
# made would have lived forever). A later delta appends only to a stream that is there (NOMKSTREAM: no command added
# to a step's deltas to find out); one that finds none makes it as a first delta does. A request that has ended (its
# deadline's expiry, or a cancel no worker answered, wrote what its caller was streamed as its output) takes no more
# deltas: its stream still adds up to its output. Returns 1, or 0 for such a delta.
DELTA_LUA = f"""
local s = redis.call('HGET', KEYS[2], 'state')
if s and ({TERMINAL_LUA})[s] then return 0 end
if ARGV[6] == '1' or not redis.call('XADD', KEYS[1], 'NOMKSTREAM', '*', 'd', ARGV[1]) then
  redis.call('XADD', KEYS[1], '*', 'd', ARGV[1])
  local ttl = tonumber(ARGV[2])
  local rec = redis.call('PTTL', KEYS[2])
  if rec > 0 then ttl = math.max(ttl, rec + tonumber(ARGV[3])) end
  redis.call('PEXPIRE', KEYS[1], ttl)
end
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
"""

EVENTS_SLACK_S = 10  # what the stream outlives its record by, beyond the expiry grace: gateway and worker clocks
