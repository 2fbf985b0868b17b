//! The metadata server's store: a map in memory, optionally backed by an append-only log in a
//! data directory so a restart (even after `kill -9`) loses no acknowledged write.
//!
//! Log record: `u32 key_len | u32 value_len (u32::MAX = delete) | key | value | u32 crc32` (all
//! little-endian; the checksum covers everything before it). A write is acknowledged only after
//! its record reached the disk (`fdatasync`). On open the log is replayed up to the first torn or
//! corrupt record (what a crash mid-write leaves), cut there, and compacted when mostly stale.
//! A running store compacts too, whenever the log holds more than twice as many records as there
//! are keys (plus 64): the live entries go to a new file that atomically replaces the log, so a
//! server whose engines re-publish for months keeps a log the size of its data.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock};

const DELETE: u32 = u32::MAX;
const LOG: &str = "metadata.log";

/// A stored value (reference-counted, so reads do not copy it).
pub type Value = axum::body::Bytes;

struct Log {
    file: File,
    path: PathBuf,
    /// Bytes of intact records: what a failed append is cut back to.
    len: u64,
    /// Records in the log (live or stale): compaction is due when they far outnumber the keys.
    records: usize,
    /// Record count below which no compaction is tried: raised after a failed attempt, so a
    /// failing disk does not cost a full rewrite on every write.
    retry_after: usize,
    /// Set when the log could not be brought back to a known state: no more writes.
    poisoned: bool,
    /// Held for the store's lifetime: one server per data directory.
    _lock: File,
}

impl Log {
    /// Replaces the log by the live entries of `map` (which every acknowledged write has
    /// reached). A failure before the replace leaves the old log in use and is only logged (the
    /// write that triggered it is already durable); the next attempt waits until the log has
    /// grown by as much again. After the replace, appends must go to the new file: if it cannot
    /// be opened, or the replace cannot be made durable (a crash could bring the old log back
    /// without the writes that follow), the store refuses writes.
    fn compact(&mut self, map: &HashMap<String, Value>) {
        let Some(dir) = self.path.parent().map(Path::to_path_buf) else { return };
        let synced = match write_compacted(&dir, &self.path, map) {
            Ok(()) => Ok(()),
            Err(CompactionError::OldLogInPlace(e)) => {
                tracing::warn!(path = %self.path.display(), error = %e, "metadata log compaction failed; the log keeps growing");
                self.retry_after = self.records + map.len() + 64;
                return;
            }
            Err(CompactionError::Renamed(e)) => Err(e),
        };
        let reopened = OpenOptions::new().append(true).open(&self.path).and_then(|f| Ok((f.metadata()?.len(), f)));
        match (reopened, synced) {
            (Ok((len, file)), Ok(())) => {
                tracing::debug!(path = %self.path.display(), dropped = self.records - map.len(), "metadata log compacted");
                (self.file, self.len, self.records, self.retry_after) = (file, len, map.len(), 0);
            }
            (Ok((len, file)), Err(e)) => {
                tracing::error!(path = %self.path.display(), error = %e, "the compacted metadata log's directory cannot be synced; refusing writes");
                (self.file, self.len, self.records, self.poisoned) = (file, len, map.len(), true);
            }
            (Err(e), _) => {
                tracing::error!(path = %self.path.display(), error = %e, "cannot reopen the compacted metadata log; refusing writes");
                self.poisoned = true;
            }
        }
    }
}

/// Key/value store of the metadata server.
pub struct Store {
    map: RwLock<HashMap<String, Value>>,
    log: Option<Mutex<Log>>,
    /// Held by every write from its check to its end, so that checks (the cap on stored bytes)
    /// and writes do not interleave.
    writes: Mutex<()>,
    /// Bytes of the keys and values stored (changed under `writes`).
    bytes: AtomicUsize,
}

/// A write refused because it would take the store past its cap
/// ([`Store::put_within`]). Its `Display` says by how much.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreFull {
    /// Bytes stored (keys and values).
    pub stored: usize,
    /// Bytes the write would have added.
    pub adding: usize,
    /// The cap.
    pub max_total: usize,
}

impl std::fmt::Display for StoreFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the metadata server holds {} bytes of keys and values; storing {} more would pass its cap of {} bytes",
            self.stored, self.adding, self.max_total
        )
    }
}

/// Bytes an entry counts for against the cap: its key and its value.
fn entry_size(key: &str, value: &[u8]) -> usize {
    key.len() + value.len()
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("persistent", &self.log.is_some()).field("keys", &self.len()).finish()
    }
}

fn record(key: &str, value: Option<&[u8]>) -> Vec<u8> {
    let mut r = Vec::with_capacity(12 + key.len() + value.map_or(0, <[u8]>::len));
    r.extend_from_slice(&(key.len() as u32).to_le_bytes());
    r.extend_from_slice(&value.map_or(DELETE, |v| v.len() as u32).to_le_bytes());
    r.extend_from_slice(key.as_bytes());
    if let Some(v) = value {
        r.extend_from_slice(v);
    }
    let crc = crc32fast::hash(&r);
    r.extend_from_slice(&crc.to_le_bytes());
    r
}

/// Whether a log of `records` records for `keys` live keys is mostly stale.
fn compaction_due(records: usize, keys: usize) -> bool {
    records > 2 * keys + 64
}

/// Why a compaction failed.
enum CompactionError {
    /// Before the new log took the old one's name: the old log is intact and still in place.
    OldLogInPlace(io::Error),
    /// After: the new log has the name, but the rename may not be durable yet.
    Renamed(io::Error),
}

/// Writes `map` as a new log and atomically puts it in place of the log at `path` (whose
/// directory is `dir`). A crash at any point leaves either the old log or the new one.
fn write_compacted(dir: &Path, path: &Path, map: &HashMap<String, Value>) -> Result<(), CompactionError> {
    let tmp = dir.join(format!("{LOG}.tmp"));
    let written = (|| {
        let mut f = io::BufWriter::new(File::create(&tmp)?);
        for (k, v) in map {
            f.write_all(&record(k, Some(v)))?;
        }
        f.into_inner().map_err(io::IntoInnerError::into_error)?.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(CompactionError::OldLogInPlace(e));
    }
    File::open(dir).and_then(|d| d.sync_all()).map_err(CompactionError::Renamed)
}

/// Replays `bytes`; returns the map, the length of the valid prefix and the record count.
fn replay(bytes: &[u8]) -> (HashMap<String, Value>, usize, usize) {
    let mut map = HashMap::new();
    let (mut at, mut records) = (0usize, 0usize);
    while let Some(head) = bytes.get(at..at + 8) {
        let klen = u32::from_le_bytes(head[0..4].try_into().expect("4 bytes")) as usize;
        let vraw = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes"));
        let vlen = if vraw == DELETE { 0 } else { vraw as usize };
        let Some(end) = (at + 8).checked_add(klen).and_then(|e| e.checked_add(vlen)) else { break };
        let Some(crc) = bytes.get(end..end + 4) else { break };
        if crc32fast::hash(&bytes[at..end]) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            break;
        }
        let Ok(key) = std::str::from_utf8(&bytes[at + 8..at + 8 + klen]) else { break };
        if vraw == DELETE {
            map.remove(key);
        } else {
            map.insert(key.to_owned(), Value::copy_from_slice(&bytes[at + 8 + klen..end]));
        }
        at = end + 4;
        records += 1;
    }
    (map, at, records)
}

impl Store {
    /// A store in memory only.
    pub fn in_memory() -> Self {
        Self { map: RwLock::new(HashMap::new()), log: None, writes: Mutex::new(()), bytes: AtomicUsize::new(0) }
    }

    /// Opens (creating if needed) the store in `dir`, replaying its log.
    pub fn open(dir: &Path) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let lock = File::create(dir.join("LOCK"))?;
        lock.try_lock().map_err(|_| {
            io::Error::new(io::ErrorKind::WouldBlock, format!("{} is in use by another metadata server", dir.display()))
        })?;
        let path = dir.join(LOG);
        let mut bytes = Vec::new();
        if path.exists() {
            File::open(&path)?.read_to_end(&mut bytes)?;
        }
        let (map, valid, records) = replay(&bytes);
        if valid < bytes.len() {
            tracing::warn!(
                path = %path.display(),
                dropped = bytes.len() - valid,
                "metadata log ends in a torn or corrupt record (a crash mid-write); it is cut there"
            );
        }
        // Compact when most records are stale (or the tail was cut): write the live entries to a
        // new file and atomically replace the log.
        let mut records = records;
        if valid < bytes.len() || compaction_due(records, map.len()) {
            write_compacted(dir, &path, &map)
                .map_err(|(CompactionError::OldLogInPlace(e) | CompactionError::Renamed(e))| e)?;
            records = map.len();
        }
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        // The file's directory entry must be durable too, or a power loss could lose the file.
        File::open(dir)?.sync_all()?;
        let len = file.metadata()?.len();
        tracing::info!(path = %path.display(), keys = map.len(), "metadata store opened");
        let log = Log { file, path, len, records, retry_after: 0, poisoned: false, _lock: lock };
        let bytes = map.iter().map(|(k, v)| entry_size(k, v)).sum();
        Ok(Self {
            map: RwLock::new(map),
            log: Some(Mutex::new(log)),
            writes: Mutex::new(()),
            bytes: AtomicUsize::new(bytes),
        })
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<Value> {
        self.map.read().unwrap_or_else(|p| p.into_inner()).get(key).cloned()
    }

    /// Sets `key` (durably, when persistent, before returning), whatever the size of the store.
    pub fn put(&self, key: &str, value: &[u8]) -> io::Result<()> {
        self.put_within(key, value, usize::MAX).map(|_| ())
    }

    /// Sets `key` unless that would take the bytes stored (keys and values, see
    /// [`bytes`](Self::bytes)) past `max_total`: then nothing is written and the inner result is
    /// [`StoreFull`]. A write that does not grow the store (a value replaced by one no larger)
    /// is accepted even in a store already past the cap (a cap lowered across a restart).
    pub fn put_within(&self, key: &str, value: &[u8], max_total: usize) -> io::Result<Result<(), StoreFull>> {
        let _writing = self.writes.lock().unwrap_or_else(|p| p.into_inner());
        let stored = self.bytes.load(Ordering::Acquire);
        let replaced = self.get(key).map_or(0, |old| entry_size(key, &old));
        let after = stored - replaced + entry_size(key, value);
        if after > max_total && after > stored {
            return Ok(Err(StoreFull { stored, adding: after - stored, max_total }));
        }
        self.append(key, Some(value), || {
            self.map.write().unwrap_or_else(|p| p.into_inner()).insert(key.to_owned(), Value::copy_from_slice(value));
        })?;
        self.bytes.store(after, Ordering::Release);
        Ok(Ok(()))
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> io::Result<bool> {
        let _writing = self.writes.lock().unwrap_or_else(|p| p.into_inner());
        let Some(old) = self.get(key) else { return Ok(false) };
        let mut existed = false;
        self.append(key, None, || {
            existed = self.map.write().unwrap_or_else(|p| p.into_inner()).remove(key).is_some();
        })?;
        self.bytes.fetch_sub(entry_size(key, &old), Ordering::AcqRel);
        Ok(existed)
    }

    /// Bytes stored: the lengths of every key and value (what the server's cap,
    /// `--max-total-bytes`, bounds; the map's own overhead is not counted).
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
    }

    /// Writes the log record, then applies `apply`, both under the log lock so the log's order
    /// is the map's order.
    fn append(&self, key: &str, value: Option<&[u8]>, apply: impl FnOnce()) -> io::Result<()> {
        match &self.log {
            None => {
                apply();
                Ok(())
            }
            Some(log) => {
                let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
                if log.poisoned {
                    return Err(io::Error::other(format!(
                        "{}: an earlier write failed; refusing writes",
                        log.path.display()
                    )));
                }
                let rec = record(key, value);
                let written = log.file.write_all(&rec).and_then(|()| log.file.sync_data());
                if let Err(e) = written {
                    // Cut the log back to its intact records, so that writes after this one are
                    // not hidden behind a partial record, and a failed write does not come back
                    // after a restart. If even that fails, the file cannot be trusted: stop.
                    let len = log.len;
                    if log.file.set_len(len).and_then(|()| log.file.sync_data()).is_err() {
                        log.poisoned = true;
                    }
                    return Err(io::Error::new(e.kind(), format!("{}: {e}", log.path.display())));
                }
                log.len += rec.len() as u64;
                log.records += 1;
                apply();
                let map = self.map.read().unwrap_or_else(|p| p.into_inner());
                if log.records >= log.retry_after && compaction_due(log.records, map.len()) {
                    log.compact(&map);
                }
                Ok(())
            }
        }
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.map.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ferry-store-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn survives_reopen_and_a_torn_tail() {
        let d = dir("torn");
        {
            let s = Store::open(&d).unwrap();
            s.put("a", b"1").unwrap();
            s.put("b", b"2").unwrap();
            s.put("a", b"3").unwrap();
            assert!(s.delete("b").unwrap());
            assert!(!s.delete("b").unwrap());
        }
        // A crash mid-write: half a record at the end.
        let rec = record("c", Some(b"lost"));
        OpenOptions::new().append(true).open(d.join(LOG)).unwrap().write_all(&rec[..rec.len() - 3]).unwrap();
        let s = Store::open(&d).unwrap();
        assert_eq!(s.get("a").as_deref(), Some(&b"3"[..]));
        assert_eq!(s.get("b"), None);
        assert_eq!(s.get("c"), None);
        s.put("d", b"4").unwrap();
        drop(s);
        let s = Store::open(&d).unwrap();
        assert_eq!(s.get("d").as_deref(), Some(&b"4"[..]), "writes after a cut tail are kept");
        assert_eq!(s.len(), 2);
        let e = Store::open(&d).unwrap_err();
        assert!(e.to_string().contains("in use by another metadata server"), "{e}");
    }

    #[test]
    fn a_running_store_compacts_its_log_and_keeps_every_value() {
        let d = dir("compact");
        let s = Store::open(&d).unwrap();
        for round in 0..1000u32 {
            s.put(&format!("k{}", round % 10), &round.to_le_bytes()).unwrap();
            if round % 100 == 99 {
                assert!(s.delete("k0").unwrap());
            }
        }
        // 1000 puts and 10 deletes of 10 keys: without compaction the log would hold 1010
        // records; with it, never more than 2 x 10 + 64 + 1.
        let size = std::fs::metadata(d.join(LOG)).unwrap().len();
        let one = record("k0", Some(&0u32.to_le_bytes())).len() as u64;
        assert!(size <= (2 * 10 + 65) * one, "log is {size} bytes, {} records", size / one);
        assert!(!d.join(format!("{LOG}.tmp")).exists());
        // Writes after a compaction go to the new log, and a reopen sees them all.
        s.put("after", b"x").unwrap();
        drop(s);
        let s = Store::open(&d).unwrap();
        assert_eq!(s.get("after").as_deref(), Some(&b"x"[..]));
        assert_eq!(s.get("k0"), None, "deleted in the last round");
        for k in 1..10u32 {
            assert_eq!(s.get(&format!("k{k}")).as_deref(), Some(&(990 + k).to_le_bytes()[..]), "k{k}");
        }
        assert_eq!(s.len(), 10);
    }

    #[test]
    fn a_failed_compaction_keeps_the_old_log_and_every_write() {
        let d = dir("compact-fails");
        let s = Store::open(&d).unwrap();
        // The new log cannot be created (its name is taken by a directory): every compaction
        // attempt fails before touching the log.
        std::fs::create_dir_all(d.join(format!("{LOG}.tmp"))).unwrap();
        for round in 0..500u32 {
            s.put(&format!("k{}", round % 5), &round.to_le_bytes()).unwrap();
        }
        let one = record("k0", Some(&0u32.to_le_bytes())).len() as u64;
        assert_eq!(std::fs::metadata(d.join(LOG)).unwrap().len(), 500 * one, "every write appended, nothing cut");
        // Once the obstacle is gone the next attempt (after the back-off) compacts.
        std::fs::remove_dir(d.join(format!("{LOG}.tmp"))).unwrap();
        for round in 500..1200u32 {
            s.put(&format!("k{}", round % 5), &round.to_le_bytes()).unwrap();
        }
        assert!(std::fs::metadata(d.join(LOG)).unwrap().len() < 500 * one, "compacted after the failure");
        // After a success the usual bound applies again (the back-off is forgotten).
        for round in 1200..1500u32 {
            s.put(&format!("k{}", round % 5), &round.to_le_bytes()).unwrap();
        }
        let size = std::fs::metadata(d.join(LOG)).unwrap().len();
        assert!(size <= (2 * 5 + 65) * one, "log is {} records", size / one);
        drop(s);
        let s = Store::open(&d).unwrap();
        for k in 0..5u32 {
            assert_eq!(s.get(&format!("k{k}")).as_deref(), Some(&(1495 + k).to_le_bytes()[..]), "k{k}");
        }
    }

    proptest! {
        /// Replaying any prefix of a valid log, or a log with a flipped byte, never panics and
        /// yields exactly the state after the last intact record.
        #[test]
        fn replay_of_damaged_logs(ops in prop::collection::vec((0u8..4, prop::collection::vec(any::<u8>(), 0..20), any::<bool>()), 1..20),
                                  cut in any::<prop::sample::Index>(), flip in any::<prop::sample::Index>()) {
            let mut log = Vec::new();
            let mut states = vec![(0usize, HashMap::<String, Vec<u8>>::new())];
            for (k, v, del) in &ops {
                let key = format!("k{k}");
                log.extend(record(&key, if *del { None } else { Some(v) }));
                let mut m = states.last().unwrap().1.clone();
                if *del { m.remove(&key); } else { m.insert(key, v.clone()); }
                states.push((log.len(), m));
            }
            let at = cut.index(log.len() + 1);
            let (map, valid, _) = replay(&log[..at]);
            let expect = states.iter().rev().find(|(end, _)| *end <= at).unwrap();
            prop_assert_eq!(valid, expect.0);
            let got: HashMap<String, Vec<u8>> = map.into_iter().map(|(k, v)| (k, v.to_vec())).collect();
            prop_assert_eq!(&got, &expect.1);
            let mut damaged = log.clone();
            let i = flip.index(damaged.len());
            damaged[i] ^= 0x5A;
            // CRC-32 catches every single-byte change: replay stops at the damaged record.
            let (map, valid, _) = replay(&damaged);
            let expect = states.iter().rev().find(|(end, _)| *end <= i).unwrap();
            prop_assert_eq!(valid, expect.0);
            let got: HashMap<String, Vec<u8>> = map.into_iter().map(|(k, v)| (k, v.to_vec())).collect();
            prop_assert_eq!(&got, &expect.1);
        }
    }
}
