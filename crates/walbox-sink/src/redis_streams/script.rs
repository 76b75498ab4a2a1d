//! The server-side append: one Lua script call writes a batch of entries in
//! order, atomically as to other clients, and stops at the first one it
//! cannot write, so that a batch is stored as a prefix (a pipeline of XADDs
//! is not: one can fail and the next be stored). Per entry it:
//!
//! 1. checks, before the first entry of each stream in the call, that the
//!    stream's newest entry is this writer's (`walbox_writer`): another
//!    writer's entry there stops walbox, naming both; and that the stream's
//!    last-generated-id is no higher than every id this writer generated
//!    there (kept per stream in the hash `walbox:ids:<writer>`, written in
//!    the same call; the newest entry's id when it holds none): a higher one
//!    is an entry another writer added and deleted since, which would put
//!    every later position below the top (each event appended, at least
//!    once instead of exactly once), so it stops walbox naming the stream
//!    and both ids. walbox's own entries deleted by a consumer, appended
//!    after the top, or copied by a replay stay within its ids;
//! 2. adds the entry at its id (the position); when Redis refuses it as
//!    "equal or smaller than the target stream top item", reads the entry at
//!    that id: the same event id and key is a duplicate (already stored),
//!    another event id (or the same one with another key) stops walbox
//!    naming both, and no entry at all (the position is
//!    below what the stream holds: a retaken snapshot, a replay) appends the
//!    event after the top, at `<top ms>-*` with the milliseconds part made
//!    odd (positions are even), so that it never takes a later position's id;
//! 3. in a replay, always appends after the top, and records per stream, in
//!    a hash of the replay's own (`walbox:replay:<writer>:<name>`), its mark
//!    (the highest position of an event it appended) and the first and last
//!    ids of its copies (`<mark> <first> <last>`). A run of the same replay
//!    again (after a kill) names, for an event at or below the mark, the
//!    entry the sink found holding a copy of it from this replay
//!    ([`super::Writer`] reads the copies back once per session, from the
//!    first id to the last); the script counts the event as a duplicate
//!    only if that entry still holds it (its event id, key, writer and
//!    replay name), and appends it otherwise: an event the earlier run never
//!    wrote (of a table or prefix added to the configuration since), or
//!    whose copy was deleted or trimmed since, is stored.
//!
//! A key of another type (WRONGTYPE) refuses its entry alone (it is about
//! the record's stream: it goes to a dead letter), and the call goes on.
//!
//! Calls are chained: each names the call its session sent before it for the
//! same flow, and writes nothing (it answers `behind`) unless the writer's
//! hash `walbox:ids:<writer>` records that call as stored whole (in the
//! flow's field: `walbox:session` for the relay's events,
//! `walbox:session:<name>` for replay `<name>`; no stream name can be one,
//! topics being of `[a-zA-Z0-9._-]`). A call that was stored whole records
//! itself there. So with several calls of a session in flight, one that
//! stopped, failed or never ran leaves the ones of its flow sent after it
//! unwritten, and a stale call of an ended session is left unwritten once a
//! later session of the same flow wrote; a `dlq replay` beside the relay
//! chains apart from it.
//!
//! The reply is `{outcomes, failed_at, kind, details...}`: one outcome per
//! entry (its id, `dup`, `+<id>` when appended after the top, `!<error>` when
//! refused alone), and
//! for the entry that stopped the call its 1-based number and why (`behind`
//! at the first entry when the call before it was not stored whole).

use redis::Value;

/// The script. KEYS[i] is entry i's stream; ARGV[1] the writer, ARGV[2] the
/// replay's progress hash (empty outside a replay), ARGV[3] the writer's hash
/// of the highest id it generated per stream, ARGV[4] the mark of the call
/// this one follows (empty: none), ARGV[5] this call's mark, ARGV[6] the
/// field of the writer's hash holding the flow's last mark; then per entry:
/// mode (`n`: at its id, `a`: after the top), event id, the id of the entry
/// holding a copy of it from an earlier run of the replay (empty: none), the
/// count of trimming arguments, the count of field names and values, and then
/// the trimming arguments, the id and the field names and values: XADD's own
/// arguments after the key, passed on from ARGV as they are.
pub const APPEND: &str = r#"
local writer = ARGV[1]
local progress = ARGV[2]
local ownkey = ARGV[3]
local before = ARGV[4]
local this_call = ARGV[5]
local chain = ARGV[6]
if before ~= '' and redis.call('HGET', ownkey, chain) ~= before then
  return {{}, 1, 'behind'}
end
local pos = 7
local out = {}
local checked = {}
local function field(fields, name)
  for j = 1, #fields, 2 do
    if fields[j] == name then return fields[j + 1] end
  end
  return ''
end
-- A field of the entry whose names and values are ARGV[first..last].
local function argfield(first, last, name)
  for j = first, last, 2 do
    if ARGV[j] == name then return ARGV[j + 1] end
  end
  return ''
end
local function above(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if not am or not bm then return true end
  if #am ~= #bm then return #am > #bm end
  if am ~= bm then return am > bm end
  if #as ~= #bs then return #as > #bs end
  return as > bs
end
local function is_id(a)
  return type(a) == 'string' and string.match(a, '^%d+%-%d+$') ~= nil
end
-- The highest id this writer generated in each stream (its hash ARGV[3]),
-- as known before this call; and the last id this call generated there,
-- its highest (a stream's ids only grow). Written back before the script
-- returns.
local own = {}
local latest = {}
local function finish(reply)
  for key, r in pairs(latest) do
    if not own[key] or above(r, own[key]) then redis.call('HSET', ownkey, key, r) end
  end
  return reply
end
-- What this replay recorded of a stream: {mark, first, last} (an earlier
-- form, `<position> <copy id> <event id>`, gives its copy as the last, the
-- first unknown), or false.
local recorded = {}
local function progress_of(key)
  if recorded[key] ~= nil then return recorded[key] end
  local p = false
  local v = redis.call('HGET', progress, key)
  if v then
    local mark, first, last = string.match(v, '^(%d+%-%d+) (%d+%-%d+) (%d+%-%d+)$')
    if mark then
      p = {mark, first, last}
    else
      local pos, at = string.match(v, '^(%d+%-%d+) (%d+%-%d+) ')
      if pos then p = {pos, '0-0', at} end
    end
  end
  recorded[key] = p
  return p
end
-- XADD of the entry whose arguments are ARGV[first..last] (the id at
-- ARGV[first + ntrim]) at another id.
local function add_at(key, first, ntrim, last, at)
  local call = {'XADD', key}
  for j = first, first + ntrim - 1 do call[#call + 1] = ARGV[j] end
  call[#call + 1] = at
  for j = first + ntrim + 1, last do call[#call + 1] = ARGV[j] end
  return redis.pcall(unpack(call))
end
for i = 1, #KEYS do
  local key = KEYS[i]
  local mode = ARGV[pos]
  local eid = ARGV[pos + 1]
  local copy = ARGV[pos + 2]
  local ntrim = tonumber(ARGV[pos + 3])
  local nfields = tonumber(ARGV[pos + 4])
  local first = pos + 5
  local id = ARGV[first + ntrim]
  local fields = first + ntrim + 1
  local lastarg = first + ntrim + nfields
  pos = lastarg + 1
  local wrongtype = false
  if not checked[key] then
    local top = redis.pcall('XREVRANGE', key, '+', '-', 'COUNT', 1)
    if top.err and string.find(top.err, 'WRONGTYPE', 1, true) then
      wrongtype = top.err
    elseif top.err then return finish({out, i, 'error', top.err}) end
    if not wrongtype and #top > 0 and field(top[1][2], 'walbox_writer') ~= writer then
      return finish({out, i, 'writer', top[1][1], field(top[1][2], 'walbox_writer'),
              field(top[1][2], 'event_id')})
    end
    if not wrongtype then
      -- An entry added and deleted since walbox's last: the stream's last
      -- id above every id this writer generated there (or its newest
      -- entry, when it recorded none).
      local info = redis.pcall('XINFO', 'STREAM', key)
      if not info.err then
        local last = '0-0'
        for j = 1, #info, 2 do
          if info[j] == 'last-generated-id' then last = info[j + 1] end
        end
        local bound = '0-0'
        if #top > 0 then bound = top[1][1] end
        local mine = redis.call('HGET', ownkey, key)
        if is_id(mine) and above(mine, bound) then bound = mine end
        if is_id(last) and above(last, bound) then
          return finish({out, i, 'lastid', last, bound})
        end
        own[key] = bound
      end
      checked[key] = true
    end
  end
  local after = mode == 'a'
  local held = false
  if after and copy ~= '' and not wrongtype then
    -- Stored by an earlier run of this replay: only if the entry named
    -- still holds its copy.
    local c = redis.pcall('XRANGE', key, copy, copy)
    if not c.err and #c > 0 then
      local f = c[1][2]
      held = field(f, 'event_id') == eid and field(f, 'key') == argfield(fields, lastarg, 'key')
        and field(f, 'walbox_writer') == writer
        and field(f, 'walbox_replay') == argfield(fields, lastarg, 'walbox_replay')
    end
  end
  if held then
    out[#out + 1] = 'dup'
    after = false
  elseif wrongtype then
    -- A key of another type refuses this entry alone: the next ones go on.
    out[#out + 1] = '!' .. wrongtype
    after = false
  elseif not after then
    local r = redis.pcall('XADD', key, unpack(ARGV, first, lastarg))
    if type(r) == 'table' and r.err then
      if not string.find(r.err, 'equal or smaller', 1, true) then
        return finish({out, i, 'error', r.err})
      end
      local at = redis.call('XRANGE', key, id, id)
      if #at > 0 then
        local other = field(at[1][2], 'event_id')
        if other ~= eid then
          return finish({out, i, 'taken', id, field(at[1][2], 'walbox_writer'), other})
        end
        if field(at[1][2], 'key') ~= argfield(fields, lastarg, 'key') then
          return finish({out, i, 'rekeyed', id, field(at[1][2], 'walbox_writer'), other})
        end
        out[#out + 1] = 'dup'
      else
        after = true
      end
    else
      latest[key] = r
      out[#out + 1] = r
    end
  end
  if after then
    local at = id
    local info = redis.pcall('XINFO', 'STREAM', key)
    if not info.err then
      for j = 1, #info, 2 do
        if info[j] == 'last-generated-id' then
          -- An odd milliseconds part: positions are WAL record LSNs, which
          -- are even, so no event written later at its own id (the rest of
          -- the transaction at the top) finds its id taken by this entry.
          local ms = string.match(info[j + 1], '^(%d+)')
          local last = tonumber(string.sub(ms, -1))
          if last % 2 == 0 then ms = string.sub(ms, 1, -2) .. tostring(last + 1) end
          at = ms .. '-*'
        end
      end
    end
    local r = add_at(key, first, ntrim, lastarg, at)
    if type(r) == 'table' and r.err then return finish({out, i, 'error', r.err}) end
    latest[key] = r
    if mode == 'a' and progress ~= '' then
      local p = progress_of(key)
      if not p then
        p = {id, r, r}
      else
        if above(id, p[1]) then p[1] = id end
        if above(p[2], r) then p[2] = r end
        if above(r, p[3]) then p[3] = r end
      end
      recorded[key] = p
      redis.call('HSET', progress, key, p[1] .. ' ' .. p[2] .. ' ' .. p[3])
    end
    out[#out + 1] = '+' .. r
  end
end
if this_call ~= '' then redis.call('HSET', ownkey, chain, this_call) end
return finish({out, 0})
"#;

/// What became of one entry the script wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Written {
    /// Stored at its own id.
    Stored,
    /// Already stored at its id (the entry there holds the same event id).
    Duplicate,
    /// Stored after the top of the stream, at this id.
    Appended(String),
    /// Refused for its stream alone (a key of another type); later entries
    /// were written.
    Refused(String),
}

/// Why the script stopped at an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// The stream's newest entry is another writer's.
    OtherWriter {
        /// That entry's id.
        id: String,
        /// Its writer (empty: none named).
        writer: String,
        /// Its event id (empty: none).
        event_id: String,
    },
    /// The stream's last-generated-id is above every id this writer
    /// generated there: another writer added an entry and deleted it.
    LastId {
        /// The stream's last-generated-id.
        last: String,
        /// The highest id this writer generated there (or the newest
        /// entry's id, `0-0` for an empty stream).
        own: String,
    },
    /// The entry at the event's id holds another event.
    Taken {
        /// The id.
        id: String,
        /// The writer of the entry there.
        writer: String,
        /// Its event id.
        event_id: String,
        /// The event id is the same, the key another.
        other_key: bool,
    },
    /// The call the session sent before this one was not stored whole:
    /// nothing of this one was written.
    Behind,
    /// Redis refused the command (out of memory, a key of another type, an
    /// ACL).
    Error(String),
}

/// The script's reply: what became of the entries written, in order, and
/// the entry (0-based) that stopped it with why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// One per entry written.
    pub written: Vec<Written>,
    /// The entry that was not written, and why; none after it was sent.
    pub stop: Option<(usize, Stop)>,
}

fn text(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        Value::ServerError(e) => e.details().unwrap_or_default().to_owned(),
        _ => String::new(),
    }
}

/// Reads the script's reply; `None` when it is not of the script's form.
#[must_use]
pub fn parse_reply(v: &Value) -> Option<Reply> {
    let Value::Array(parts) = v else { return None };
    let written = match parts.first()? {
        Value::Array(items) => items
            .iter()
            .map(|i| {
                let t = text(i);
                match t.as_str() {
                    "dup" => Written::Duplicate,
                    _ => match (t.strip_prefix('+'), t.strip_prefix('!')) {
                        (Some(id), _) => Written::Appended(id.to_owned()),
                        (_, Some(e)) => Written::Refused(e.to_owned()),
                        _ => Written::Stored,
                    },
                }
            })
            .collect(),
        _ => return None,
    };
    let at = match parts.get(1)? {
        Value::Int(i) => usize::try_from(*i).ok()?,
        _ => return None,
    };
    if at == 0 {
        return Some(Reply {
            written,
            stop: None,
        });
    }
    let arg = |n: usize| parts.get(n).map(text).unwrap_or_default();
    let stop = match arg(2).as_str() {
        "writer" => Stop::OtherWriter {
            id: arg(3),
            writer: arg(4),
            event_id: arg(5),
        },
        "lastid" => Stop::LastId {
            last: arg(3),
            own: arg(4),
        },
        kind @ ("taken" | "rekeyed") => Stop::Taken {
            id: arg(3),
            writer: arg(4),
            event_id: arg(5),
            other_key: kind == "rekeyed",
        },
        "behind" => Stop::Behind,
        _ => Stop::Error(arg(3)),
    };
    Some(Reply {
        written,
        stop: Some((at - 1, stop)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn a_reply_tells_stored_duplicates_and_appended_entries_apart() {
        let v = Value::Array(vec![
            Value::Array(vec![
                bulk("5-0"),
                bulk("dup"),
                bulk("+9-3"),
                bulk("!WRONGTYPE Operation against a key"),
            ]),
            Value::Int(0),
        ]);
        assert_eq!(
            parse_reply(&v),
            Some(Reply {
                written: vec![
                    Written::Stored,
                    Written::Duplicate,
                    Written::Appended("9-3".into()),
                    Written::Refused("WRONGTYPE Operation against a key".into())
                ],
                stop: None
            })
        );
    }

    #[test]
    fn a_stop_names_the_entry_and_both_event_ids() {
        let v = Value::Array(vec![
            Value::Array(vec![bulk("5-0")]),
            Value::Int(2),
            bulk("taken"),
            bulk("6-0"),
            bulk("walbox-a"),
            bulk("other-event"),
        ]);
        let r = parse_reply(&v).expect("parses");
        assert_eq!(
            r.stop,
            Some((
                1,
                Stop::Taken {
                    id: "6-0".into(),
                    writer: "walbox-a".into(),
                    event_id: "other-event".into(),
                    other_key: false,
                }
            ))
        );
        let v = Value::Array(vec![
            Value::Array(vec![]),
            Value::Int(1),
            bulk("writer"),
            bulk("1700000000000-0"),
            bulk(""),
            bulk(""),
        ]);
        assert!(matches!(
            parse_reply(&v).expect("parses").stop,
            Some((0, Stop::OtherWriter { .. }))
        ));
        let v = Value::Array(vec![
            Value::Array(vec![]),
            Value::Int(1),
            bulk("lastid"),
            bulk("1700000000000-0"),
            bulk("400-0"),
        ]);
        assert_eq!(
            parse_reply(&v).expect("parses").stop,
            Some((
                0,
                Stop::LastId {
                    last: "1700000000000-0".into(),
                    own: "400-0".into(),
                }
            ))
        );
        let v = Value::Array(vec![
            Value::Array(vec![]),
            Value::Int(1),
            bulk("error"),
            bulk("OOM command not allowed"),
        ]);
        assert_eq!(
            parse_reply(&v).expect("parses").stop,
            Some((0, Stop::Error("OOM command not allowed".into())))
        );
        assert_eq!(parse_reply(&Value::Nil), None);
    }
}
