"""The Lua scripts of :class:`atp_router.store.redis.RedisStore` (one module so the
store's Python stays readable). Each script is run by EVALSHA with

* ``KEYS[1]`` = ``<ns>:epoch`` and ``ARGV[1]`` = the epoch the store opened
  with: a script first checks it and answers ``ATPEPOCH`` when Redis lost its
  data (the marker is gone or another one);
* ``ARGV[2]`` = the key prefix ``<ns>:``;
* ``ARGV[3]`` = the operation's **deadline** on Redis' own clock (Unix ms,
  ``TIME``; '' none): a script that runs later — Redis was stopped or stalled
  and reads the command from a connection whose caller gave up — answers
  ``ATPLATE <ms late>`` and changes nothing;
* ``ARGV[4]``, ``ARGV[5]`` = the **fencing token** of a router's write: its
  owner name and the lease epoch it holds ('' '': none). When another router
  settled that owner (``fence_owner``: ``le:<owner>`` incremented), a write
  with the old epoch answers ``ATPFENCED <owner>`` and changes nothing;
* the operation's own arguments follow and are ``A[1]``, ``A[2]``, ... inside
  the script.

Errors are ``redis.error_reply("<CODE> <details>")`` with the codes ``ATPEPOCH``,
``ATPLATE <ms>``, ``ATPFENCED <owner>``,
``ATPNOTFOUND acct|res|stream <what>``, ``ATPOPEN <account>``, ``ATPHELD <id>``,
``ATPLIMIT events_per_stream <stream key>`` and ``ATPDUP event|audit <...>``;
the store turns them into :mod:`atp_router.store.base` errors.

Numbers: Redis' Lua numbers are doubles, exact up to 2**53; amounts are written
back with ``string.format('%d')`` (a plain ``tostring`` of a double above 1e14
gives ``1e+14`` notation, which Redis would refuse as an integer). Ledger
amounts are therefore bounded by 2**53 (USD 9 billion in micros), checked by
the store before a call.

Key layout under the prefix P (``<ns>:``):

==================  =======================================================
``epoch``           the epoch marker (a uuid set once, ``SET NX``)
``layout``          ``atp-router/<LAYOUT_VERSION>``
``a:<key>``         account hash: p (parent, '' none), lt, lu (limits, ''
                    unlimited), ct, cu, rt, ru, ot, ou (committed, reserved,
                    overage tokens / USD micros), o (1 open, 0 closed), w
                    (owner, '' none), kids (open children)
``ao`` / ``ac``     sets of the open / closed accounts
``aw:<owner>``      set of the open accounts ``owner`` opened
``r:<id>``          reservation hash: a (account), t, u, w (owner)
``rs``              zset of the open reservation ids (score: the id)
``rw:<owner>``      set of ``owner``'s open reservation ids
``rid``             the last reservation id handed out (INCR)
``owners``          set of owners that may own something (pruned)
``s:<sk>``          stream hash (sk = JSON [tenant, session, stream]): b
                    (record JSON), st, cr, cm (state, close reason, closed
                    ms), c (created ms), q (insertion sequence), n (events),
                    w (owner), xi / xs (its idempotency / stream-id index keys)
``e:<sk>``          zset of its events: score the event id, member
                    ``b"<id> <len(type)> <type><frame>"``
``so``, ``so:<w>``  zsets of the open streams (all / of owner ``w``), score c
``sd``              zset of the closed or interrupted streams, score cm
``si:<json>``       zset of the streams of [tenant, idempotency key], score c
``sx:<json>``       zset of the streams of [tenant, stream id], score c
``sq``              the stream insertion sequence (INCR)
``rib``             list of the last RIB_KEPT RIBs (JSON [v, text, source, actor])
``ribv`` / ``ribmax`` / ``ribseq``  active version / highest saved / handed out
``au`` / ``acp``    zsets of audit records / checkpoints (score seq, member JSON)
``kv:<key>``        kv value; ``kvi``: zset (score 0) of the kv keys, by bytes
``c:<hex>``         cache entry hash: v, t (tenant), c, x, u (created,
                    expires, used ms); PX TTL until it expires
``cu`` / ``cx``     zsets of cache keys by last use / expiry; ``cz``: hash
                    hex -> value size; ``ct``: hash n (entries), b (bytes)
``co`` / ``ctb``    hashes hex -> owning tenant / tenant -> its values' bytes;
``cut:<tenant>``    zset of that tenant's cache keys by last use
``cm:<json>``        call record (json = JSON [tenant, idempotency key, agent,
                    n]): hash v (the answer), t, u (what its commit charged);
                    written by the commit's own step, PX ttl
``l:<owner>``       lease (info JSON), SET PX ttl; ``ls``: set of leased owners
``le:<owner>``      the owner's lease epoch (fencing token; absent: 0),
                    incremented when another router settles it
``cl:<name>``       claim: its holder, SET PX ttl
``q:<json>``        zset of a tenant's quota entries (json = JSON [tenant]):
                    member JSON [owner, stream id], score its expiry (Unix
                    ms, Redis' clock); PX TTL past the latest expiry
``qw:<owner>``      set of ``owner``'s quota entries, each JSON [JSON
                    [tenant], member]; PX TTL like its entries
``qr:<key>``        a GCRA bucket's theoretical arrival time (ms, Redis'
                    clock; keys ``open/<tenant>``, ``learn/<tenant>``); PX
                    TTL until it is full again
``nz:<json>``       zset of a tenant's nonces of signed frames (json = JSON
                    [tenant]): member JSON [kid, nonce], score its expiry
                    (Unix ms, the callers' clock); PX TTL until the last
                    expires
==================  =======================================================
"""

from __future__ import annotations

__all__ = ["LAYOUT_VERSION", "OPEN", "SCRIPTS"]

#: Version of the key layout above; a namespace with another is refused.
LAYOUT_VERSION = 1

# Run without the epoch check, at open: KEYS = layout, epoch; ARGV = our layout,
# a fresh epoch. Returns {layout found (or ours, now set), the epoch (or false
# when the layout is not ours: nothing written)}.
OPEN = """
local lay = redis.call('GET', KEYS[1])
if lay and lay ~= ARGV[1] then return {lay, false} end
if not lay then redis.call('SET', KEYS[1], ARGV[1]) end
local ep = redis.call('GET', KEYS[2])
if not ep then redis.call('SET', KEYS[2], ARGV[2]); ep = ARGV[2] end
return {ARGV[1], ep}
"""

_PRELUDE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('ATPEPOCH the epoch marker is gone or changed')
end
local P = ARGV[2]
local function I(n) return string.format('%d', n) end
if ARGV[3] ~= '' then
  local tm = redis.call('TIME')
  local late = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000) - tonumber(ARGV[3])
  if late > 0 then return redis.error_reply('ATPLATE ' .. I(late)) end
end
if ARGV[4] ~= '' and (redis.call('GET', P .. 'le:' .. ARGV[4]) or '0') ~= ARGV[5] then
  return redis.error_reply('ATPFENCED ' .. ARGV[4])
end
local A = {}
for i = 6, #ARGV do A[i - 5] = ARGV[i] end
local function nf(kind, what) return redis.error_reply('ATPNOTFOUND ' .. kind .. ' ' .. what) end
"""

_LEDGER = """
local INF = math.huge
local function akey(k) return P .. 'a:' .. k end
local function lim(v) if v == false or v == '' then return false end return tonumber(v) end
local function free(l, c, r) if l == false then return INF end return l - c - r end
local function is_open(k) return redis.call('HGET', akey(k), 'o') == '1' end
-- The account and its ancestors, nearest first: {key, lt, lu, ct, cu, rt, ru, ot, ou, open}.
local function chain(k)
  local rows = {}
  while k and k ~= '' do
    local h = redis.call('HMGET', akey(k), 'p', 'lt', 'lu', 'ct', 'cu', 'rt', 'ru', 'ot', 'ou', 'o')
    if not h[10] then break end
    rows[#rows + 1] = {k, lim(h[2]), lim(h[3]), tonumber(h[4]), tonumber(h[5]), tonumber(h[6]),
                       tonumber(h[7]), tonumber(h[8]), tonumber(h[9]), h[10] == '1'}
    k = h[1]
    if #rows > 10000 then error('the account chain of ' .. rows[1][1] .. ' loops') end
  end
  return rows
end
local function encode(rows)
  local out = {}
  for i, r in ipairs(rows) do out[i] = {r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9]} end
  return out
end
-- Add to every account of rows (and to the rows themselves).
local function move(rows, t, u, ot, ou, rt, ru)
  local d = {t, u, rt, ru, ot, ou}
  local f = {'ct', 'cu', 'rt', 'ru', 'ot', 'ou'}
  for _, r in ipairs(rows) do
    for j = 1, 6 do
      if d[j] ~= 0 then r[j + 3] = tonumber(redis.call('HINCRBY', akey(r[1]), f[j], I(d[j]))) end
    end
  end
end
-- The index (1-based) of the nearest account that cannot hold t / u more, or 0.
local function no_room(rows, t, u)
  for i, r in ipairs(rows) do
    if t > free(r[2], r[4], r[6]) or u > free(r[3], r[5], r[7]) then return i end
  end
  return 0
end
-- The guard of a named commit (request q; mode 'recommit': the retry of one whose answer was
-- lost): a recommit of a name an attempt already ran returns that attempt's reply (nothing
-- applied twice), else marks the name ('x', ttl ms) so the first attempt arriving late is
-- refused; a first attempt whose name was settled by a recommit is refused. nil: go on.
local function named_commit(q, mode, ttl)
  if q == '' then return nil end
  local qk = P .. 'rq:' .. q
  local done = redis.call('GET', qk)
  if mode == 'recommit' then
    if done and done ~= 'x' then
      local key, dt, du, dot, dou = string.match(done, '^(.*)|(%d+)|(%d+)|(%d+)|(%d+)$')
      return {encode(chain(key)), tonumber(dt), tonumber(du), tonumber(dot), tonumber(dou)}
    end
    redis.call('SET', qk, 'x', 'PX', ttl)
  elseif done then
    return redis.error_reply('ATPCANCELLED commit ' .. q .. ' was settled again before it ran')
  end
  return nil
end
local function del_res(id, w)
  redis.call('DEL', P .. 'r:' .. id)
  redis.call('ZREM', P .. 'rs', id)
  if w and w ~= '' then redis.call('SREM', P .. 'rw:' .. w, id) end
end
local function close_acct(key)
  local k = akey(key)
  local h = redis.call('HMGET', k, 'o', 'p', 'w')
  if h[1] ~= '1' then return false end
  redis.call('HSET', k, 'o', '0')
  redis.call('SREM', P .. 'ao', key)
  redis.call('SADD', P .. 'ac', key)
  if h[2] and h[2] ~= '' then redis.call('HINCRBY', akey(h[2]), 'kids', -1) end
  if h[3] and h[3] ~= '' then redis.call('SREM', P .. 'aw:' .. h[3], key) end
  return true
end
-- Open account key (checked closed) under parent (checked open, '' none), limits lt / lu ('' none).
local function open_acct(key, parent, lt, lu, owner)
  redis.call('HSET', akey(key), 'p', parent, 'lt', lt, 'lu', lu, 'ct', '0', 'cu', '0', 'ot', '0', 'ou', '0',
             'rt', '0', 'ru', '0', 'o', '1', 'w', owner)
  redis.call('SADD', P .. 'ao', key)
  redis.call('SREM', P .. 'ac', key)
  if parent ~= '' then redis.call('HINCRBY', akey(parent), 'kids', 1) end
  if owner ~= '' then
    redis.call('SADD', P .. 'aw:' .. owner, key)
    redis.call('SADD', P .. 'owners', owner)
  end
end
-- BudgetLedger.set_limit on rows[1]: mode 'clamp' or 'strict'; false when refused.
local function set_limit(rows, lt, lu, mode)
  local r = rows[1]
  local held_t, held_u = r[4] + r[6], r[5] + r[7]
  if mode == 'clamp' then
    if lt then lt = math.max(lt, held_t) end
    if lu then lu = math.max(lu, held_u) end
  elseif (lt and lt < held_t) or (lu and lu < held_u) then
    return false
  end
  redis.call('HSET', akey(r[1]), 'lt', lt and I(lt) or '', 'lu', lu and I(lu) or '')
  return true
end
"""

_STREAMS = """
local function skey(sk) return P .. 's:' .. sk end
-- Drop stream sk from every index (its fields xi, xs, w given).
local function unindex(sk, xi, xs, w)
  if xi and xi ~= '' then redis.call('ZREM', xi, sk) end
  if xs and xs ~= '' then redis.call('ZREM', xs, sk) end
  redis.call('ZREM', P .. 'so', sk)
  if w and w ~= '' then redis.call('ZREM', P .. 'so:' .. w, sk) end
  redis.call('ZREM', P .. 'sd', sk)
end
"""

# Shared tenant quotas (atp_router.flow.quota): Redis' clock, and one GCRA take.
_QUOTA = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Extend key k's TTL to at least ttl ms (never shorten: other entries may last longer).
local function keep(k, ttl)
  if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
end
-- One take of GCRA bucket rk at now: 0 taken (its time moved), else the ms until one would pass.
local function gcra(rk, per_s, burst, now)
  local T = 1000 / per_s
  local v = redis.call('GET', rk)
  local base = now
  if v then base = math.max(tonumber(v), now) end
  local new = base + T
  local over = new - now - burst * T
  if over > 1e-9 then return math.max(1, math.ceil(over)) end
  redis.call('SET', rk, string.format('%.3f', new), 'PX', I(math.max(1, math.ceil(new - now))))
  return 0
end
-- Up to n takes of GCRA bucket rk at now: taken (>= 1, its time moved by as many) and 0, else 0 and
-- the ms until one would pass.
local function gcra_upto(rk, per_s, burst, n, now)
  local T = 1000 / per_s
  local v = redis.call('GET', rk)
  local base = now
  if v then base = math.max(tonumber(v), now) end
  local k = math.min(n, math.floor((now + burst * T - base) / T + 1e-9))
  if k < 1 then return 0, math.max(1, math.ceil(base + T - now - burst * T)) end
  local new = base + k * T
  redis.call('SET', rk, string.format('%.3f', new), 'PX', I(math.max(1, math.ceil(new - now))))
  return k, 0
end
-- Take a stream's entry in a tenant's shared quota (quota_open): tkey JSON [tenant], member JSON
-- [owner, stream], went its owner entry; admitted, the entry is held ttl ms. Refused: nothing but
-- the tenant's expired entries is changed. -> admitted 1|0, open, refused ('' | 'streams' | 'rate'), retry ms
local function quota_take(tkey, member, went, owner, max_streams, per_s, burst, ttl_ms, rate_key)
  local now = now_ms()
  local zk, ttl = P .. 'q:' .. tkey, tonumber(ttl_ms)
  redis.call('ZREMRANGEBYSCORE', zk, '-inf', I(now))
  local n = redis.call('ZCARD', zk)
  local again = redis.call('ZSCORE', zk, member)
  if not again then
    if n >= tonumber(max_streams) then return 0, n, 'streams', 0 end
    local wait = gcra(P .. 'qr:' .. rate_key, tonumber(per_s), tonumber(burst), now)
    if wait > 0 then return 0, n, 'rate', wait end
    n = n + 1
  end
  redis.call('ZADD', zk, I(now + ttl), member)
  keep(zk, ttl)
  local wk = P .. 'qw:' .. owner
  redis.call('SADD', wk, went)
  keep(wk, ttl)
  redis.call('SADD', P .. 'owners', owner)
  return 1, n, '', 0
end
"""

_CACHE = """
local function remove(hex)
  local sz = redis.call('HGET', P .. 'cz', hex)
  if not sz then return 0 end
  redis.call('HDEL', P .. 'cz', hex)
  local owner = redis.call('HGET', P .. 'co', hex)
  if owner then
    redis.call('HDEL', P .. 'co', hex)
    redis.call('ZREM', P .. 'cut:' .. owner, hex)
    redis.call('HINCRBY', P .. 'ctb', owner, I(-tonumber(sz)))
  end
  redis.call('DEL', P .. 'c:' .. hex)
  redis.call('ZREM', P .. 'cu', hex)
  redis.call('ZREM', P .. 'cx', hex)
  redis.call('HINCRBY', P .. 'ct', 'n', -1)
  redis.call('HINCRBY', P .. 'ct', 'b', I(-tonumber(sz)))
  return 1
end
"""

_BODIES: dict[str, tuple[str, str]] = {
    # ------------------------------------------------------------ ledger (journal)
    # A: key, parent, lt, lu, owner, mode ('plain' | 'shared') -> chain
    "open_account": (_LEDGER, """
local key, parent, owner = A[1], A[2], A[5]
if A[6] == 'shared' and parent == '' and is_open(key) then
  set_limit(chain(key), lim(A[3]), lim(A[4]), 'clamp')
  return encode(chain(key))
end
if parent ~= '' and not is_open(parent) then return nf('acct', parent) end
if is_open(key) then return redis.error_reply('ATPOPEN ' .. key) end
open_acct(key, parent, A[3], A[4], owner)
return encode(chain(key))
"""),
    # A: key
    "close_account": (_LEDGER, """
if not close_acct(A[1]) then return nf('acct', A[1]) end
return 1
"""),
    # A: key -> 1 closed | 0 it was not open (closed by the router that settled its owner)
    "close_account_if_open": (_LEDGER, """
if not close_acct(A[1]) then return 0 end
return 1
"""),
    # A: id, key, t, u: record (or grow to these totals) a reservation of the local ledger.
    "reserve": (_LEDGER, """
local id, key = A[1], A[2]
if not is_open(key) then return nf('acct', key) end
local rk = P .. 'r:' .. id
local old = redis.call('HMGET', rk, 't', 'u')
local t, u = tonumber(A[3]), tonumber(A[4])
redis.call('HSET', rk, 'a', key, 't', A[3], 'u', A[4])
redis.call('ZADD', P .. 'rs', id, id)
move(chain(key), 0, 0, 0, 0, t - tonumber(old[1] or '0'), u - tonumber(old[2] or '0'))
if tonumber(id) > tonumber(redis.call('GET', P .. 'rid') or '0') then redis.call('SET', P .. 'rid', id) end
return 1
"""),
    # A: id, mode ('release' | 'charge' | 'actual' | 'recommit'), t, u, ot, ou[, request, request ttl ms
    #   [, call record key, its value, its ttl ms]]
    #   -> {chain, t, u, ot, ou} charged. A named commit records 'key|t|u|ot|ou' under rq:<request>;
    #   'recommit' (the retry of a named commit whose answer was lost) returns that record's charge if
    #   an attempt ran (nothing applied twice), else settles like 'actual' and records its charge under
    #   the name, so the first attempt arriving late is refused and a further retry returns it. A
    #   charge is never negative (an account already past its limit: 0, the rest overage).
    #   A call record (the answer the charge paid for) is stored in the same step under cm:<key>
    #   (hash v, t, u: the value and the charge), so a re-run finds the answer iff it was charged.
    "settle": (_LEDGER, """
local id, mode, q = A[1], A[2], A[7] or ''
local qk = P .. 'rq:' .. q
local function record(t, u)
  if (A[9] or '') == '' then return end
  local ck = P .. 'cm:' .. A[9]
  redis.call('HSET', ck, 'v', A[10], 't', I(t), 'u', I(u))
  redis.call('PEXPIRE', ck, A[11])
end
local again = named_commit(q, mode, A[8])
if again then return again end
if mode == 'recommit' then mode = 'actual' end
local h = redis.call('HMGET', P .. 'r:' .. id, 'a', 't', 'u', 'w')
if not h[1] then return nf('res', id) end
local ht, hu = tonumber(h[2]), tonumber(h[3])
local rows = chain(h[1])
local ct, cu, ot, ou = 0, 0, 0, 0
if mode == 'charge' then
  ct, cu, ot, ou = tonumber(A[3]), tonumber(A[4]), tonumber(A[5]), tonumber(A[6])
elseif mode == 'actual' then
  local room_t, room_u = INF, INF
  for _, r in ipairs(rows) do
    room_t = math.min(room_t, free(r[2], r[4], r[6]))
    room_u = math.min(room_u, free(r[3], r[5], r[7]))
  end
  local t, u = tonumber(A[3]), tonumber(A[4])
  ct, cu = math.max(0, math.min(t, room_t + ht)), math.max(0, math.min(u, room_u + hu))
  ot, ou = t - ct, u - cu
end
move(rows, ct, cu, ot, ou, -ht, -hu)
del_res(id, h[4])
if q ~= '' then
  redis.call('SET', qk, h[1] .. '|' .. I(ct) .. '|' .. I(cu) .. '|' .. I(ot) .. '|' .. I(ou), 'PX', A[8])
end
if mode ~= 'release' then record(ct, cu) end
return {encode(rows), ct, cu, ot, ou}
"""),
    # A: key, lt, lu, mode ('plain' | 'clamp' | 'strict') -> {ok, chain}
    "set_limit": (_LEDGER, """
local key = A[1]
if A[4] == 'plain' then
  if not is_open(key) then return nf('acct', key) end
  redis.call('HSET', akey(key), 'lt', A[2], 'lu', A[3])
  return {1, {}}
end
local rows = chain(key)
if #rows == 0 or not rows[1][10] then return nf('acct', key) end
if not set_limit(rows, lim(A[2]), lim(A[3]), A[4]) then return {0, encode(rows)} end
return {1, encode(chain(key))}
"""),
    # -> {open accounts {key, parent, lt, lu, ct, cu, ot, ou}, reservations {id, key, t, u}, last id}
    "load_ledger": (_LEDGER, """
local accts, res = {}, {}
for _, k in ipairs(redis.call('SMEMBERS', P .. 'ao')) do
  local h = redis.call('HMGET', akey(k), 'p', 'lt', 'lu', 'ct', 'cu', 'ot', 'ou', 'o')
  if h[8] == '1' then accts[#accts + 1] = {k, h[1], h[2], h[3], h[4], h[5], h[6], h[7]} end
end
for _, id in ipairs(redis.call('ZRANGE', P .. 'rs', 0, -1)) do
  local h = redis.call('HMGET', P .. 'r:' .. id, 'a', 't', 'u')
  if h[1] then res[#res + 1] = {id, h[1], h[2], h[3]} end
end
return {accts, res, redis.call('GET', P .. 'rid') or '0'}
"""),
    # A: owner ('' every one), mode ('commit' | 'release') -> {{id, key, t, u}...} in id order
    "settle_owned": (_LEDGER, """
local ids
if A[1] == '' then ids = redis.call('ZRANGE', P .. 'rs', 0, -1)
else ids = redis.call('SMEMBERS', P .. 'rw:' .. A[1]) end
table.sort(ids, function(a, b) return tonumber(a) < tonumber(b) end)
local out = {}
for _, id in ipairs(ids) do
  local h = redis.call('HMGET', P .. 'r:' .. id, 'a', 't', 'u', 'w')
  if h[1] then
    local t, u = tonumber(h[2]), tonumber(h[3])
    if A[2] == 'commit' then move(chain(h[1]), t, u, 0, 0, -t, -u)
    else move(chain(h[1]), 0, 0, 0, 0, -t, -u) end
    del_res(id, h[4])
    out[#out + 1] = {id, h[1], h[2], h[3]}
  end
end
if A[1] ~= '' then redis.call('DEL', P .. 'rw:' .. A[1]) end
return out
"""),
    # A: owner ('' every owner) -> how many accounts were closed
    "close_owned": (_LEDGER, """
local owners = {A[1]}
if A[1] == '' then owners = redis.call('SMEMBERS', P .. 'owners') end
local n = 0
for _, o in ipairs(owners) do
  for _, key in ipairs(redis.call('SMEMBERS', P .. 'aw:' .. o)) do
    if close_acct(key) then n = n + 1 end
  end
  redis.call('DEL', P .. 'aw:' .. o)
end
return n
"""),
    # ------------------------------------------------------------ ledger (shared)
    # A: key, t, u, owner, request ('' none), request ttl ms -> {1, id, chain} | {0, refusing index, chain}
    "reserve_shared": (_LEDGER, """
local key, owner, q = A[1], A[4], A[5]
if q ~= '' and redis.call('EXISTS', P .. 'rq:' .. q) == 1 then
  return redis.error_reply('ATPCANCELLED reserve ' .. q .. ' was cancelled before it ran')
end
local rows = chain(key)
if #rows == 0 or not rows[1][10] then return nf('acct', key) end
local t, u = tonumber(A[2]), tonumber(A[3])
local bad = no_room(rows, t, u)
if bad > 0 then return {0, bad, encode(rows)} end
local id = redis.call('INCR', P .. 'rid')
redis.call('HSET', P .. 'r:' .. id, 'a', key, 't', A[2], 'u', A[3], 'w', owner)
if q ~= '' then redis.call('SET', P .. 'rq:' .. q, id, 'PX', A[6]) end
redis.call('ZADD', P .. 'rs', id, id)
if owner ~= '' then
  redis.call('SADD', P .. 'rw:' .. owner, id)
  redis.call('SADD', P .. 'owners', owner)
end
move(rows, 0, 0, 0, 0, t, u)
return {1, id, encode(rows)}
"""),
    # A: id, key, held t, held u, t, u -> {1, 0, chain} | {0, refusing index, chain}
    "extend_shared": (_LEDGER, """
local id, key = A[1], A[2]
local rk = P .. 'r:' .. id
local h = redis.call('HMGET', rk, 'a', 't', 'u')
if not h[1] then return nf('res', id) end
if h[1] ~= key or tonumber(h[2]) ~= tonumber(A[3]) or tonumber(h[3]) ~= tonumber(A[4]) then
  return redis.error_reply('ATPHELD ' .. id)
end
local rows = chain(key)
if #rows == 0 or not rows[1][10] then return nf('acct', key) end
local t, u = tonumber(A[5]), tonumber(A[6])
local bad = no_room(rows, t, u)
if bad > 0 then return {0, bad, encode(rows)} end
redis.call('HINCRBY', rk, 't', A[5])
redis.call('HINCRBY', rk, 'u', A[6])
move(rows, 0, 0, 0, 0, t, u)
return {1, 0, encode(rows)}
"""),
    # A: request, ttl ms -> 1 (its reservation released) | 0 (none made; the request refused from now on)
    "cancel_reserve": (_LEDGER, """
local qk = P .. 'rq:' .. A[1]
local id = redis.call('GET', qk)
redis.call('SET', qk, 'x', 'PX', A[2])
if not id or id == 'x' then return 0 end
local h = redis.call('HMGET', P .. 'r:' .. id, 'a', 't', 'u', 'w')
if not h[1] then return 0 end
move(chain(h[1]), 0, 0, 0, 0, -tonumber(h[2]), -tonumber(h[3]))
del_res(id, h[4])
return 1
"""),
    # ------------------------------------------------ budget leases (issue 22 item 2)
    # A router's slice of a tenant's remaining budget: a reservation (r:<id>, owner w) on the
    # stream's parent account, so a lost router's slice is released with its reservations.
    # A: parent key, lease id ('' a new one), want t, want u, owner, request ('' none), request ttl ms
    #   -> {id, granted t, granted u, chain}: the slice grown by min(want, the chain's free room), or
    #   shrunk by -want (a negative want, at most what it holds: given back). Named: a take sent
    #   again under its request (its answer was lost) returns what the first one did, applied once.
    "lease_take": (_LEDGER, """
local key, id, owner, q = A[1], A[2], A[5], A[6]
local qk = P .. 'rq:' .. q
if q ~= '' then
  local done = redis.call('GET', qk)
  if done then
    local did, dt, du = string.match(done, '^L(%d+)|(-?%d+)|(-?%d+)$')
    if not did then return redis.error_reply('ATPCANCELLED lease take ' .. q .. ' is not a lease take') end
    return {tonumber(did), tonumber(dt), tonumber(du), encode(chain(key))}
  end
end
local rows = chain(key)
if #rows == 0 or not rows[1][10] then return nf('acct', key) end
local room_t, room_u = INF, INF
for _, r in ipairs(rows) do
  room_t = math.min(room_t, free(r[2], r[4], r[6]))
  room_u = math.min(room_u, free(r[3], r[5], r[7]))
end
local t = math.max(0, math.min(tonumber(A[3]), room_t))
local u = math.max(0, math.min(tonumber(A[4]), room_u))
if id ~= '' then
  local h = redis.call('HMGET', P .. 'r:' .. id, 'a', 'w', 't', 'u')
  if not h[1] then return nf('res', id) end
  if h[1] ~= key or h[2] ~= owner then return redis.error_reply('ATPHELD ' .. id) end
  if tonumber(A[3]) < 0 then t = -math.min(-tonumber(A[3]), tonumber(h[3])) end
  if tonumber(A[4]) < 0 then u = -math.min(-tonumber(A[4]), tonumber(h[4])) end
  redis.call('HINCRBY', P .. 'r:' .. id, 't', I(t))
  redis.call('HINCRBY', P .. 'r:' .. id, 'u', I(u))
else
  id = redis.call('INCR', P .. 'rid')
  redis.call('HSET', P .. 'r:' .. id, 'a', key, 't', I(t), 'u', I(u), 'w', owner)
  redis.call('ZADD', P .. 'rs', id, id)
  redis.call('SADD', P .. 'rw:' .. owner, id)
  redis.call('SADD', P .. 'owners', owner)
end
move(rows, 0, 0, 0, 0, t, u)
if q ~= '' then redis.call('SET', qk, 'L' .. id .. '|' .. I(t) .. '|' .. I(u), 'PX', A[7]) end
return {tonumber(id), t, u, encode(rows)}
"""),
    # The commit of a call reserved in a lease (no reservation of its own in the store).
    # A: lease id, stream key, cap t, cap u (what the lease may give the call), stream room t, u
    #   ('' unbounded: the router's own room on the stream account), actual t, u, mode ('actual' |
    #   'recommit'), request, request ttl ms[, call record key, its value, its ttl ms]
    #   -> {chain, t, u, ot, ou} charged: per axis min(actual, the stream room, each ancestor's free
    #   room plus what the lease gives), the rest overage; the lease's part leaves its hold (a cap
    #   is never below 0: a slice never grows by a commit). Named and recorded like 'settle' (a
    #   recommit returns the charge of whichever attempt ran).
    "lease_settle": (_LEDGER, """
local id, skey, mode, q = A[1], A[2], A[9], A[10]
local qk = P .. 'rq:' .. q
local again = named_commit(q, mode, A[11])
if again then return again end
local h = redis.call('HMGET', P .. 'r:' .. id, 'a', 't', 'u')
if not h[1] then return nf('res', id) end
local rows = chain(skey)
if #rows < 2 or rows[2][1] ~= h[1] then return redis.error_reply('ATPHELD ' .. id) end
local capt = math.max(0, math.min(tonumber(A[3]), tonumber(h[2])))
local capu = math.max(0, math.min(tonumber(A[4]), tonumber(h[3])))
local s = rows[1]
local room_t, room_u = free(s[2], s[4], s[6]), free(s[3], s[5], s[7])
if A[5] ~= '' then room_t = math.min(room_t, tonumber(A[5])) end
if A[6] ~= '' then room_u = math.min(room_u, tonumber(A[6])) end
local up = {}
for i = 2, #rows do
  local r = rows[i]
  up[#up + 1] = r
  room_t = math.min(room_t, free(r[2], r[4], r[6]) + capt)
  room_u = math.min(room_u, free(r[3], r[5], r[7]) + capu)
end
local t, u = tonumber(A[7]), tonumber(A[8])
local ct, cu = math.max(0, math.min(t, room_t)), math.max(0, math.min(u, room_u))
local ot, ou = t - ct, u - cu
local lt, lu = math.min(ct, capt), math.min(cu, capu)
move({s}, ct, cu, ot, ou, 0, 0)
move(up, ct, cu, ot, ou, -lt, -lu)
if lt ~= 0 then redis.call('HINCRBY', P .. 'r:' .. id, 't', I(-lt)) end
if lu ~= 0 then redis.call('HINCRBY', P .. 'r:' .. id, 'u', I(-lu)) end
if q ~= '' then
  redis.call('SET', qk, skey .. '|' .. I(ct) .. '|' .. I(cu) .. '|' .. I(ot) .. '|' .. I(ou), 'PX', A[11])
end
if (A[12] or '') ~= '' then
  local ck = P .. 'cm:' .. A[12]
  redis.call('HSET', ck, 'v', A[13], 't', I(ct), 'u', I(cu))
  redis.call('PEXPIRE', ck, A[14])
end
return {encode(rows), ct, cu, ot, ou}
"""),
    # A: call record key -> {value, charged t, charged u} | false
    "call_record": ("", """
local h = redis.call('HMGET', P .. 'cm:' .. A[1], 'v', 't', 'u')
if not h[1] then return false end
return h
"""),
    # A: key -> chain (open)
    "shared_totals": (_LEDGER, """
local rows = chain(A[1])
if #rows == 0 or not rows[1][10] then return nf('acct', A[1]) end
return encode(rows)
"""),
    # ------------------------------------------------------------ leases and claims
    # A: owner, ttl ms, info JSON -> {its lease epoch, Redis TIME seconds, microseconds}
    "heartbeat": ("", """
redis.call('SET', P .. 'l:' .. A[1], A[3], 'PX', A[2])
redis.call('SADD', P .. 'ls', A[1])
local tm = redis.call('TIME')
return {redis.call('GET', P .. 'le:' .. A[1]) or '0', tm[1], tm[2]}
"""),
    # A: owner, ttl ms, info JSON -> {its lease epoch, Redis TIME seconds, microseconds, {owner, info, ...}}:
    #    heartbeat and live_owners in one step (a cluster router's renewal)
    "renew_lease": ("", """
redis.call('SET', P .. 'l:' .. A[1], A[3], 'PX', A[2])
redis.call('SADD', P .. 'ls', A[1])
local tm = redis.call('TIME')
local out = {}
for _, o in ipairs(redis.call('SMEMBERS', P .. 'ls')) do
  local v = redis.call('GET', P .. 'l:' .. o)
  if v then out[#out + 1] = o; out[#out + 1] = v else redis.call('SREM', P .. 'ls', o) end
end
return {redis.call('GET', P .. 'le:' .. A[1]) or '0', tm[1], tm[2], out}
"""),
    # A: owner -> its new lease epoch: every write it made with the old one is refused from now on
    "fence_owner": ("", """
return redis.call('INCR', P .. 'le:' .. A[1])
"""),
    # -> {owner, info, owner, info, ...}
    "live_owners": ("", """
local out = {}
for _, o in ipairs(redis.call('SMEMBERS', P .. 'ls')) do
  local v = redis.call('GET', P .. 'l:' .. o)
  if v then out[#out + 1] = o; out[#out + 1] = v else redis.call('SREM', P .. 'ls', o) end
end
return out
"""),
    # A: owner
    "drop_lease": ("", """
redis.call('DEL', P .. 'l:' .. A[1])
redis.call('SREM', P .. 'ls', A[1])
return 1
"""),
    # -> owners with something open and no lease (unsorted)
    "lost_owners": ("", """
local out = {}
for _, o in ipairs(redis.call('SMEMBERS', P .. 'owners')) do
  local n = redis.call('SCARD', P .. 'rw:' .. o) + redis.call('SCARD', P .. 'aw:' .. o)
            + redis.call('ZCARD', P .. 'so:' .. o) + redis.call('SCARD', P .. 'qw:' .. o)
  if n == 0 then redis.call('SREM', P .. 'owners', o)
  elseif redis.call('EXISTS', P .. 'l:' .. o) == 0 then out[#out + 1] = o end
end
return out
"""),
    # A: name, holder, ttl ms -> 1 held | 0 another holds it
    "claim": ("", """
local k = P .. 'cl:' .. A[1]
local v = redis.call('GET', k)
if v and v ~= A[2] then return 0 end
redis.call('SET', k, A[2], 'PX', A[3])
return 1
"""),
    # ------------------------------------------------------------------- streams
    # A: sk, body, state, reason ('' none, else '+' .. reason), created, closed ('' none), owner, xi, xs
    "put_stream": (_STREAMS, """
local sk, state, created, closed, owner = A[1], A[3], A[5], A[6], A[7]
local s = skey(sk)
local old = redis.call('HMGET', s, 'xi', 'xs', 'w', 'st')
if old[4] then unindex(sk, old[1], old[2], old[3]) end
redis.call('DEL', s, P .. 'e:' .. sk)
local q = redis.call('INCR', P .. 'sq')
redis.call('HSET', s, 'b', A[2], 'st', state, 'c', created, 'q', q, 'n', 0, 'w', owner, 'xi', A[8], 'xs', A[9])
if A[4] ~= '' then redis.call('HSET', s, 'cr', string.sub(A[4], 2)) end
if closed ~= '' then redis.call('HSET', s, 'cm', closed) end
if A[8] ~= '' then redis.call('ZADD', A[8], created, sk) end
redis.call('ZADD', A[9], created, sk)
if state == 'open' then
  redis.call('ZADD', P .. 'so', created, sk)
  if owner ~= '' then
    redis.call('ZADD', P .. 'so:' .. owner, created, sk)
    redis.call('SADD', P .. 'owners', owner)
  end
elseif closed ~= '' then
  redis.call('ZADD', P .. 'sd', closed, sk)
end
return 1
"""),
    # A: sk, reason, closed ms
    "close_stream": (_STREAMS, """
local sk = A[1]
local s = skey(sk)
local w = redis.call('HMGET', s, 'w', 'st')
if not w[2] then return nf('stream', sk) end
redis.call('HSET', s, 'st', 'closed', 'cr', A[2], 'cm', A[3])
redis.call('ZREM', P .. 'so', sk)
if w[1] and w[1] ~= '' then redis.call('ZREM', P .. 'so:' .. w[1], sk) end
redis.call('ZADD', P .. 'sd', A[3], sk)
return 1
"""),
    # A: sk -> {body, state, reason, closed} | nil
    "get_stream": (_STREAMS, """
local h = redis.call('HMGET', skey(A[1]), 'b', 'st', 'cr', 'cm')
if not h[1] then return false end
return h
"""),
    # A: index key -> the newest stream of the index (created, then inserted last): as get_stream
    "find_newest": (_STREAMS, """
local top = redis.call('ZREVRANGE', A[1], 0, 0, 'WITHSCORES')
if #top == 0 then return false end
local best, bq = nil, -1
for _, sk in ipairs(redis.call('ZRANGEBYSCORE', A[1], top[2], top[2])) do
  local q = tonumber(redis.call('HGET', skey(sk), 'q') or '-1')
  if q > bq then best, bq = sk, q end
end
if not best then return false end
return redis.call('HMGET', skey(best), 'b', 'st', 'cr', 'cm')
"""),
    # A: sk, max events per stream, then (event id, member) pairs: each event appended in
    # order (one for append_event, a group commit's run of one stream for append_events),
    # stopping at the first error (the ones before it stay applied). An event already
    # stored exactly so (a retried write whose first attempt was applied) changes nothing.
    "append_events": (_STREAMS, """
local sk = A[1]
local s = skey(sk)
local n = redis.call('HGET', s, 'n')
if not n then return nf('stream', sk) end
n = tonumber(n)
local max, e, added, err = tonumber(A[2]), P .. 'e:' .. sk, 0, nil
for i = 3, #A - 1, 2 do
  local id, m = A[i], A[i + 1]
  if n + added >= max then err = 'ATPLIMIT events_per_stream ' .. sk; break end
  local have = redis.call('ZRANGEBYSCORE', e, id, id)
  if #have == 0 then
    redis.call('ZADD', e, id, m)
    added = added + 1
  elseif have[1] ~= m then
    err = 'ATPDUP event ' .. id .. ' ' .. sk; break
  end
end
if added > 0 then redis.call('HINCRBY', s, 'n', added) end
if err then return redis.error_reply(err) end
return 1
"""),
    # A: sk, after -> members in id order
    "events": (_STREAMS, """
return redis.call('ZRANGEBYSCORE', P .. 'e:' .. A[1], '(' .. A[2], '+inf')
"""),
    # A: reason, now ms, owner ('' every open stream) -> {{body, created, seq}...}
    "interrupt": (_STREAMS, """
local idx = P .. 'so'
if A[3] ~= '' then idx = P .. 'so:' .. A[3] end
local out = {}
for _, sk in ipairs(redis.call('ZRANGE', idx, 0, -1)) do
  local s = skey(sk)
  local h = redis.call('HMGET', s, 'b', 'c', 'q', 'w')
  if h[1] then
    redis.call('HSET', s, 'st', 'interrupted', 'cr', A[1], 'cm', A[2])
    out[#out + 1] = {h[1], h[2], h[3]}
  end
  redis.call('ZREM', P .. 'so', sk)
  if h[4] and h[4] ~= '' then redis.call('ZREM', P .. 'so:' .. h[4], sk) end
  redis.call('ZADD', P .. 'sd', A[2], sk)
end
return out
"""),
    # A: before ms, limit -> {streams dropped, 1 if more may be left}
    "expire": (_STREAMS + _LEDGER, """
local done = redis.call('ZRANGEBYSCORE', P .. 'sd', '-inf', '(' .. A[1], 'LIMIT', 0, tonumber(A[2]))
for _, sk in ipairs(done) do
  local h = redis.call('HMGET', skey(sk), 'xi', 'xs', 'w')
  unindex(sk, h[1], h[2], h[3])
  redis.call('DEL', skey(sk), P .. 'e:' .. sk)
end
if #done >= tonumber(A[2]) then return {#done, 1} end
for _, k in ipairs(redis.call('SMEMBERS', P .. 'ac')) do
  local h = redis.call('HMGET', akey(k), 'o', 'kids')
  if h[1] ~= '1' and tonumber(h[2] or '0') <= 0 then
    redis.call('DEL', akey(k))
    redis.call('SREM', P .. 'ac', k)
  end
end
return {#done, 0}
"""),
    # ----------------------------------------------------------------------- RIB
    # A: version, JSON [version, text, source, actor], kept
    "save_rib": ("", """
redis.call('RPUSH', P .. 'rib', A[2])
redis.call('LTRIM', P .. 'rib', -tonumber(A[3]), -1)
redis.call('SET', P .. 'ribv', A[1])
if tonumber(A[1]) > tonumber(redis.call('GET', P .. 'ribmax') or '0') then redis.call('SET', P .. 'ribmax', A[1]) end
return 1
"""),
    "active_rib": ("", """
return redis.call('LINDEX', P .. 'rib', -1)
"""),
    "active_rib_version": ("", """
return redis.call('GET', P .. 'ribv')
"""),
    "next_rib_version": ("", """
local v = math.max(tonumber(redis.call('GET', P .. 'ribseq') or '0'),
                   tonumber(redis.call('GET', P .. 'ribmax') or '0')) + 1
redis.call('SET', P .. 'ribseq', I(v))
return v
"""),
    # --------------------------------------------------------------------- audit
    # A: seq, JSON, the head's seq it is chained to ('' unchecked), [the head's hash ('' unchecked)]
    #   -> 1 appended | {the head record's JSON ('' none)}: a chained append that lost the race answers
    #   the head it must be chained to (no second read); with the hash, one chained to a record of
    #   the same seq that is not the head's (a pipelined append behind one that lost) is refused too
    "append_audit": ("", """
local au = P .. 'au'
if A[3] ~= '' then
  local top = redis.call('ZREVRANGE', au, 0, 0, 'WITHSCORES')
  if tonumber(top[2] or '0') ~= tonumber(A[3]) then return {top[1] or ''} end
  -- The head's hash too: a record chained to one of ours that was refused is refused.
  if (A[4] or '') ~= '' and top[1] and cjson.decode(top[1])['hash'] ~= A[4] then return {top[1]} end
end
if redis.call('ZCOUNT', au, A[1], A[1]) > 0 then return redis.error_reply('ATPDUP audit ' .. A[1]) end
redis.call('ZADD', au, A[1], A[2])
return 1
"""),
    # A: after, limit (-1 all)
    "audit_records": ("", """
if tonumber(A[2]) < 0 then return redis.call('ZRANGEBYSCORE', P .. 'au', '(' .. A[1], '+inf') end
return redis.call('ZRANGEBYSCORE', P .. 'au', '(' .. A[1], '+inf', 'LIMIT', 0, tonumber(A[2]))
"""),
    # A: zset name ('au' | 'acp'), first (0) or last (-1), or 'all'
    "audit_read": ("", """
if A[2] == 'all' then return redis.call('ZRANGE', P .. A[1], 0, -1) end
local r = redis.call('ZRANGE', P .. A[1], tonumber(A[2]), tonumber(A[2]))
return r[1] or false
"""),
    # A: seq, JSON
    "put_audit_checkpoint": ("", """
redis.call('ZREMRANGEBYSCORE', P .. 'acp', A[1], A[1])
redis.call('ZADD', P .. 'acp', A[1], A[2])
return 1
"""),
    # ------------------------------------------------------------------------ kv
    "kv_get": ("", """
return redis.call('GET', P .. 'kv:' .. A[1])
"""),
    # A: key, value
    "kv_put": ("", """
redis.call('SET', P .. 'kv:' .. A[1], A[2])
redis.call('ZADD', P .. 'kvi', 0, A[1])
return 1
"""),
    # A: key, had ('0' | '1'), old value, keep ('0' delete | '1'), new value -> 1 done | 0 changed meanwhile
    "kv_cas": ("", """
local k = P .. 'kv:' .. A[1]
local cur = redis.call('GET', k)
if A[2] == '1' then
  if cur ~= A[3] then return 0 end
elseif cur then return 0 end
if A[4] == '1' then
  redis.call('SET', k, A[5])
  redis.call('ZADD', P .. 'kvi', 0, A[1])
else
  redis.call('DEL', k)
  redis.call('ZREM', P .. 'kvi', A[1])
end
return 1
"""),
    # A: prefix -> {key, value, key, value, ...} by key
    "kv_items": ("", """
local out = {}
for _, k in ipairs(redis.call('ZRANGEBYLEX', P .. 'kvi', '[' .. A[1], '(' .. A[1] .. '\\255')) do
  local v = redis.call('GET', P .. 'kv:' .. k)
  if v then out[#out + 1] = k; out[#out + 1] = v end
end
return out
"""),
    # -------------------------------------------------------------------- cache
    # A: hex key, now ms -> value | nil
    "cache_get": (_CACHE, """
local k = P .. 'c:' .. A[1]
local h = redis.call('HMGET', k, 'v', 'x', 'u')
if not h[1] or tonumber(h[2]) <= tonumber(A[2]) then return false end
if tonumber(h[3]) < tonumber(A[2]) then
  redis.call('HSET', k, 'u', A[2])
  redis.call('ZADD', P .. 'cu', A[2], A[1])
  local owner = redis.call('HGET', P .. 'co', A[1])
  if owner then redis.call('ZADD', P .. 'cut:' .. owner, A[2], A[1]) end
end
return h[1]
"""),
    # A: hex key, value, tenant, now, expires, max bytes, tenant max bytes ('' : none)
    # -> {stored, expired, evicted, entries, bytes}. With a tenant max: the tenant's own
    # least recently used entries go (zset cut:<tenant>, bytes in hash ctb), never
    # another tenant's; the value is not stored when the whole cache cannot hold it.
    "cache_put": (_CACHE, """
local hex, value, now, expires, max = A[1], A[2], tonumber(A[4]), tonumber(A[5]), tonumber(A[6])
local tmax = tonumber(A[7])
local expired = 0
for _, k in ipairs(redis.call('ZRANGEBYSCORE', P .. 'cx', '-inf', A[4])) do expired = expired + remove(k) end
remove(hex)
local size = string.len(value)
local stored = 0
local evicted = 0
local fits = size <= max
if tmax then
  fits = size <= math.min(max, tmax)
  if fits then
    local excess = math.max(tonumber(redis.call('HGET', P .. 'ctb', A[3]) or '0') + size - tmax,
                            tonumber(redis.call('HGET', P .. 'ct', 'b') or '0') + size - max)
    while excess > 0 do
      local page = redis.call('ZRANGE', P .. 'cut:' .. A[3], 0, 99)
      if #page == 0 then break end
      for _, k in ipairs(page) do
        if excess <= 0 then break end
        excess = excess - tonumber(redis.call('HGET', P .. 'cz', k) or '0')
        local r = remove(k)
        if r == 0 then redis.call('ZREM', P .. 'cut:' .. A[3], k) end
        evicted = evicted + r
      end
    end
    fits = tonumber(redis.call('HGET', P .. 'ct', 'b') or '0') + size <= max
  end
end
if fits then
  stored = 1
  local k = P .. 'c:' .. hex
  redis.call('HSET', k, 'v', value, 't', A[3], 'c', A[4], 'x', A[5], 'u', A[4])
  redis.call('PEXPIRE', k, I(math.max(1, expires - now)))
  redis.call('HSET', P .. 'cz', hex, I(size))
  redis.call('ZADD', P .. 'cu', A[4], hex)
  redis.call('ZADD', P .. 'cx', A[5], hex)
  redis.call('HINCRBY', P .. 'ct', 'n', 1)
  redis.call('HINCRBY', P .. 'ct', 'b', I(size))
  if tmax then
    redis.call('HSET', P .. 'co', hex, A[3])
    redis.call('ZADD', P .. 'cut:' .. A[3], A[4], hex)
    redis.call('HINCRBY', P .. 'ctb', A[3], I(size))
  end
end
local total = tonumber(redis.call('HGET', P .. 'ct', 'b') or '0')
if not tmax and total > max then
  local excess, victims, start = total - max, {}, 0
  while excess > 0 do
    local page = redis.call('ZRANGE', P .. 'cu', start, start + 99)
    if #page == 0 then break end
    for _, k in ipairs(page) do
      if excess <= 0 then break end
      if k ~= hex then
        victims[#victims + 1] = k
        excess = excess - tonumber(redis.call('HGET', P .. 'cz', k) or '0')
      end
    end
    start = start + 100
  end
  for _, k in ipairs(victims) do evicted = evicted + remove(k) end
end
local t = redis.call('HMGET', P .. 'ct', 'n', 'b')
return {stored, expired, evicted, tonumber(t[1] or '0'), tonumber(t[2] or '0')}
"""),
    "cache_drop": (_CACHE, """
return remove(A[1])
"""),
    "cache_stats": ("", """
local t = redis.call('HMGET', P .. 'ct', 'n', 'b')
return {tonumber(t[1] or '0'), tonumber(t[2] or '0')}
"""),
    # ------------------------------------------------------ shared tenant quotas
    # A: JSON [tenant], member JSON [owner, stream], owner entry, owner, max streams, per_s, burst, ttl ms,
    #    rate key -> {admitted 1|0, open, refused ('' | 'streams' | 'rate'), retry ms}
    "quota_open": (_QUOTA, """
local ok, n, why, wait = quota_take(A[1], A[2], A[3], A[4], A[5], A[6], A[7], A[8], A[9])
return {ok, n, why, wait}
"""),
    # The atomic OPEN of a stream (issue 22 item 2): its shared quota (quota_open) and its budget
    # account (open_account, a child: never adopted) in one step, or neither.
    # A: key, parent, lt, lu, owner, then quota_open's nine arguments
    #   -> {admitted 1|0, open, refused ('' | 'streams' | 'rate'), retry ms, chain ({} when refused)}
    "open_stream": (_LEDGER + _QUOTA, """
local key, parent, owner = A[1], A[2], A[5]
if parent ~= '' and not is_open(parent) then return nf('acct', parent) end
if is_open(key) then return redis.error_reply('ATPOPEN ' .. key) end
local ok, n, why, wait = quota_take(A[6], A[7], A[8], A[9], A[10], A[11], A[12], A[13], A[14])
if ok == 0 then return {0, n, why, wait, {}} end
open_acct(key, parent, A[3], A[4], owner)
return {1, n, '', 0, encode(chain(key))}
"""),
    # A: JSON [tenant], member, owner, owner entry -> 1 removed | 0 none
    "quota_close": ("", """
local r = redis.call('ZREM', P .. 'q:' .. A[1], A[2])
redis.call('SREM', P .. 'qw:' .. A[3], A[4])
return r
"""),
    # A: owner, ttl ms, the owner entries it still holds... -> how many (each now held ttl ms more; its others removed)
    "quota_renew": (_QUOTA, """
local now = now_ms()
local wk, ttl, n = P .. 'qw:' .. A[1], tonumber(A[2]), 0
local held = {}
for i = 3, #A do held[A[i]] = true end
for _, e in ipairs(redis.call('SMEMBERS', wk)) do
  local d = cjson.decode(e)
  local zk = P .. 'q:' .. d[1]
  local score = redis.call('ZSCORE', zk, d[2])
  if held[e] and score and tonumber(score) > now then
    redis.call('ZADD', zk, I(now + ttl), d[2])
    keep(zk, ttl)
    n = n + 1
  else
    redis.call('ZREM', zk, d[2])
    redis.call('SREM', wk, e)
  end
end
if n > 0 then keep(wk, ttl) end
return n
"""),
    # A: owner -> entries removed
    "quota_release_owned": ("", """
local wk, n = P .. 'qw:' .. A[1], 0
for _, e in ipairs(redis.call('SMEMBERS', wk)) do
  local d = cjson.decode(e)
  n = n + redis.call('ZREM', P .. 'q:' .. d[1], d[2])
end
redis.call('DEL', wk)
return n
"""),
    # A: JSON [tenant] -> its unexpired entries
    "quota_count": (_QUOTA, """
return redis.call('ZCOUNT', P .. 'q:' .. A[1], '(' .. I(now_ms()), '+inf')
"""),
    # A: key, per_s, burst -> 0 taken | ms until one would pass
    "rate_take": (_QUOTA, """
return gcra(P .. 'qr:' .. A[1], tonumber(A[2]), tonumber(A[3]), now_ms())
"""),
    # A: key, per_s, burst, n -> {taken (0..n), ms until one would pass (0 when taken)}
    "rate_take_upto": (_QUOTA, """
local k, wait = gcra_upto(P .. 'qr:' .. A[1], tonumber(A[2]), tonumber(A[3]), tonumber(A[4]), now_ms())
return {k, wait}
"""),
    # ------------------------------------------------------------ replay nonces
    # A: JSON [tenant], JSON [kid, nonce], now ms, expires ms, max per tenant, sweep
    # -> 1 fresh (recorded) | 0 replayed (an unexpired record) | -1 the tenant is at its bound
    "nonce_put": ("", """
local zk, member, now = P .. 'nz:' .. A[1], A[2], tonumber(A[3])
local gone = redis.call('ZRANGEBYSCORE', zk, '-inf', A[3], 'LIMIT', 0, tonumber(A[6]))
if #gone > 0 then redis.call('ZREM', zk, unpack(gone)) end
local seen = redis.call('ZSCORE', zk, member)
if seen and tonumber(seen) > now then return 0 end
if redis.call('ZCOUNT', zk, '(' .. A[3], '+inf') >= tonumber(A[5]) then return -1 end
redis.call('ZADD', zk, A[4], member)
local last = redis.call('ZRANGE', zk, -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', zk, I(math.max(1, tonumber(last[2]) - now)))
return 1
"""),
}

# The same commit unbuffered by RedisStore.batch (its answer is needed at once).
_BODIES["lease_commit"] = _BODIES["lease_settle"]

#: name -> Lua source (the prelude, the helpers it needs, its body).
SCRIPTS: dict[str, str] = {name: _PRELUDE + helpers + body for name, (helpers, body) in _BODIES.items()}
