//! The peer snapshot envelope, format 2: the exported columns framed for the wire, with the GIL away.
//!
//! Layout (little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 4 | magic `RFKS` |
//! | 2 | format (2) |
//! | 2 | flags (0; any other value is a format this reader does not know) |
//! | 8 | length of the whole envelope |
//! | 16 | xxh3-128 of every byte after this field |
//! | 4 + n | `meta`: the producer's msgpack map (identity, hashing, workers, cursors, sessions) |
//! | 8 + 8 | records, carrier entries |
//! | 6 sections | `parent` (u32 per record: how many records back its parent is, 0 for a root), `key` (u64), `ncar` (u16), `worker` (u32 per entry), `tiers` (u8), `hash` (u64) |
//!
//! A section is `codec` (u8: 0 raw, 1 LZ4 block), its stored length (u64), then the bytes. Keys and
//! engine hashes are digests, so their sections stay raw (compressing random bytes buys nothing and
//! costs most of the time: gzip level 1 ran at ~70 MB/s over format 1's body here); the other columns
//! are runs (a chain's records are one back from each other, one carrier each, one worker, one tier)
//! that LZ4 shrinks to almost nothing at memory speed. Sizes are known from the counts, so a reader
//! allocates only what the header's bounded counts allow, and never more than a ratio of what it got.

use xxhash_rust::xxh3::xxh3_128;

use crate::snapshot::Columns;

pub const MAGIC: &[u8; 4] = b"RFKS";
pub const FORMAT: u16 = 2;
const HEADER: usize = 4 + 2 + 2 + 8 + 16;
const CHECKSUM_AT: usize = 16;
const RAW: u8 = 0;
const LZ4: u8 = 1;
/// A legitimate envelope is at least 16 bytes per record (the raw key and hash), so its columns hold
/// at most ~2x its size; a claim of far more is a bomb, refused before the allocation.
pub const MAX_INFLATE_RATIO: usize = 32;

/// What a reader accepts before it allocates for what a peer claims.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_bytes: usize,
    pub max_records: u64,
    pub max_entries: u64,
    pub max_meta: usize,
}

/// Why an envelope does not read; `kind` is the metric label the Python shell's `WireErrorKind` has.
#[derive(thiserror::Error, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireError {
    #[error("malformed: {0}")]
    Malformed(&'static str),
    #[error("truncated: the envelope ends early")]
    Truncated,
    #[error("too_large: {0}")]
    TooLarge(&'static str),
    #[error("checksum: the envelope does not match its checksum")]
    Checksum,
    #[error("unknown_format")]
    UnknownFormat,
}

impl WireError {
    pub fn kind(self) -> &'static str {
        match self {
            WireError::Malformed(_) => "malformed",
            WireError::Truncated => "truncated",
            WireError::TooLarge(_) => "too_large",
            WireError::Checksum => "checksum",
            WireError::UnknownFormat => "unknown_format",
        }
    }
}

fn section(out: &mut Vec<u8>, raw: &[u8], compress: bool) {
    let packed = compress
        .then(|| lz4_flex::block::compress(raw))
        .filter(|p| p.len() < raw.len());
    let (codec, body) = match &packed {
        Some(p) => (LZ4, p.as_slice()),
        None => (RAW, raw),
    };
    out.push(codec);
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(body);
}

fn le<T: Copy, const N: usize>(xs: &[T], to: fn(T) -> [u8; N]) -> Vec<u8> {
    let mut out = Vec::with_capacity(xs.len() * N);
    xs.iter().for_each(|&x| out.extend_from_slice(&to(x)));
    out
}

/// Frame `meta` and `cols` (an export: every parent before its child).
pub fn encode(meta: &[u8], cols: &Columns) -> Vec<u8> {
    let records = cols.key.len();
    let entries = cols.worker.len();
    let mut out = Vec::with_capacity(HEADER + 4 + meta.len() + 16 + 6 * 9 + records * 10 + entries * 9);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&[0; 8 + 16]); // length and checksum, once known
    out.extend_from_slice(&(meta.len() as u32).to_le_bytes());
    out.extend_from_slice(meta);
    out.extend_from_slice(&(records as u64).to_le_bytes());
    out.extend_from_slice(&(entries as u64).to_le_bytes());
    let back: Vec<u32> = (cols.parent.iter().enumerate())
        .map(|(i, &p)| if p < 0 { 0 } else { (i as i64 - p) as u32 })
        .collect();
    section(&mut out, &le(&back, u32::to_le_bytes), true);
    drop(back);
    section(&mut out, &le(&cols.key, u64::to_le_bytes), false);
    section(&mut out, &le(&cols.ncar, u16::to_le_bytes), true);
    section(&mut out, &le(&cols.worker, u32::to_le_bytes), true);
    section(&mut out, &cols.tiers, true);
    section(&mut out, &le(&cols.hash, u64::to_le_bytes), false);
    let len = out.len() as u64;
    out[8..CHECKSUM_AT].copy_from_slice(&len.to_le_bytes());
    let sum = xxh3_128(&out[HEADER..]);
    out[CHECKSUM_AT..HEADER].copy_from_slice(&sum.to_le_bytes());
    out
}

/// Whether `data` is a format-2 envelope (or the start of one): the shells dispatch on it.
pub fn is_envelope(data: &[u8]) -> bool {
    data.starts_with(MAGIC)
}

struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        let end = end.ok_or(WireError::Malformed("a field runs past the end"))?;
        let out = &self.data[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    /// One section whose content is `raw_len` bytes, into a buffer of exactly that size.
    fn section(&mut self, raw_len: usize) -> Result<Vec<u8>, WireError> {
        let codec = self.take(1)?[0];
        let stored = usize::try_from(self.u64()?).map_err(|_| WireError::Malformed("section length"))?;
        let body = self.take(stored)?;
        match codec {
            RAW if stored == raw_len => Ok(body.to_vec()),
            RAW => Err(WireError::Malformed("a raw section of the wrong length")),
            LZ4 => {
                let mut out = vec![0u8; raw_len];
                match lz4_flex::block::decompress_into(body, &mut out) {
                    Ok(n) if n == raw_len => Ok(out),
                    _ => Err(WireError::Malformed(
                        "a compressed section does not inflate to its size",
                    )),
                }
            }
            _ => Err(WireError::Malformed("unknown section codec")),
        }
    }
}

fn column<T, const N: usize>(raw: &[u8], from: fn([u8; N]) -> T) -> Vec<T> {
    raw.chunks_exact(N)
        .map(|c| from(c.try_into().expect("exact chunk")))
        .collect()
}

/// Read an envelope: its `meta` bytes (for the shell to parse) and its columns, well-formed and NOT
/// trusted (vetting decides). Every count is bounded before anything is allocated for it.
pub fn decode(data: &[u8], limits: &Limits) -> Result<(Vec<u8>, Columns), WireError> {
    if data.len() > limits.max_bytes {
        return Err(WireError::TooLarge("envelope over the limit"));
    }
    if !is_envelope(data) {
        return Err(WireError::Malformed("not a snapshot envelope"));
    }
    if data.len() < HEADER {
        return Err(WireError::Truncated);
    }
    // Flags name features of a later format; none is defined, so any set is a format we do not read.
    if u16::from_le_bytes([data[4], data[5]]) != FORMAT || data[6..8] != [0, 0] {
        return Err(WireError::UnknownFormat);
    }
    let claimed = u64::from_le_bytes(data[8..CHECKSUM_AT].try_into().expect("8 bytes"));
    match claimed.cmp(&(data.len() as u64)) {
        std::cmp::Ordering::Greater => return Err(WireError::Truncated),
        std::cmp::Ordering::Less => return Err(WireError::Malformed("bytes after the envelope")),
        std::cmp::Ordering::Equal => {}
    }
    let sum = u128::from_le_bytes(data[CHECKSUM_AT..HEADER].try_into().expect("16 bytes"));
    if xxh3_128(&data[HEADER..]) != sum {
        return Err(WireError::Checksum);
    }
    let mut cur = Cursor { data, pos: HEADER };
    let meta_len = u32::from_le_bytes(cur.take(4)?.try_into().expect("4 bytes")) as usize;
    if meta_len > limits.max_meta {
        return Err(WireError::TooLarge("meta over the limit"));
    }
    let meta = cur.take(meta_len)?.to_vec();
    let (records, entries) = (cur.u64()?, cur.u64()?);
    if records > limits.max_records {
        return Err(WireError::TooLarge("record count over the limit"));
    }
    if entries > limits.max_entries {
        return Err(WireError::TooLarge("carrier entries over the limit"));
    }
    let (records, entries) = (records as usize, entries as usize);
    let raw_total = records * (4 + 8 + 2) + entries * (4 + 1 + 8);
    if raw_total > limits.max_bytes || raw_total > MAX_INFLATE_RATIO * data.len() + (1 << 20) {
        return Err(WireError::TooLarge("columns inflate far beyond the envelope"));
    }
    let back: Vec<u32> = column(&cur.section(records * 4)?, u32::from_le_bytes);
    let key = column(&cur.section(records * 8)?, u64::from_le_bytes);
    let ncar = column(&cur.section(records * 2)?, u16::from_le_bytes);
    let worker = column(&cur.section(entries * 4)?, u32::from_le_bytes);
    let tiers = cur.section(entries)?;
    let hash = column(&cur.section(entries * 8)?, u64::from_le_bytes);
    if cur.pos != data.len() {
        return Err(WireError::Malformed("bytes after the last section"));
    }
    if ncar.iter().map(|&n| n as usize).sum::<usize>() != entries {
        return Err(WireError::Malformed("carrier counts do not sum to the entries"));
    }
    // A distance past the first record must not read as a root (-1): it becomes -2, which vetting
    // refuses as an invalid parent.
    let parent = (back.iter().enumerate())
        .map(|(i, &d)| match i as i64 - d as i64 {
            _ if d == 0 => -1,
            p if p < 0 => -2,
            p => p,
        })
        .collect();
    Ok((
        meta,
        Columns {
            parent,
            key,
            ncar,
            worker,
            tiers,
            hash,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_bytes: 1 << 30,
        max_records: 1 << 24,
        max_entries: 1 << 26,
        max_meta: 1 << 20,
    };

    fn cols() -> Columns {
        Columns {
            parent: vec![-1, 0, 1, -1, 3],
            key: vec![11, 12, 13, 14, 15],
            ncar: vec![1, 2, 0, 1, 1],
            worker: vec![0, 1, 0, 1, 1],
            tiers: vec![1, 1, 4, 1, 2],
            hash: vec![0xdead, 0xbeef, 0xbeef, 7, 8],
        }
    }

    #[test]
    fn round_trips() {
        let data = encode(b"meta", &cols());
        assert!(is_envelope(&data));
        let (meta, back) = decode(&data, &LIMITS).unwrap();
        assert_eq!((meta.as_slice(), back), (&b"meta"[..], cols()));
        let (meta, empty) = decode(&encode(b"", &Columns::default()), &LIMITS).unwrap();
        assert_eq!((meta.len(), empty), (0, Columns::default()));
    }

    #[test]
    fn every_cut_and_every_flipped_byte_is_refused_without_a_panic() {
        let data = encode(b"meta", &cols());
        for n in 0..data.len() {
            assert!(decode(&data[..n], &LIMITS).is_err(), "cut at {n}");
            let mut bad = data.clone();
            bad[n] ^= 0x40;
            assert!(decode(&bad, &LIMITS).is_err(), "byte {n} flipped");
        }
        assert_eq!(decode(&data[..HEADER + 3], &LIMITS), Err(WireError::Truncated));
    }

    /// An envelope built by hand, checksummed, so the checks after the checksum are reached.
    fn forged(records: u64, entries: u64, sections: &[(u8, Vec<u8>)]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT.to_le_bytes());
        out.extend_from_slice(&[0; 2 + 8 + 16]);
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&records.to_le_bytes());
        out.extend_from_slice(&entries.to_le_bytes());
        for (codec, body) in sections {
            out.push(*codec);
            out.extend_from_slice(&(body.len() as u64).to_le_bytes());
            out.extend_from_slice(body);
        }
        let len = out.len() as u64;
        out[8..CHECKSUM_AT].copy_from_slice(&len.to_le_bytes());
        let sum = xxh3_128(&out[HEADER..]);
        out[CHECKSUM_AT..HEADER].copy_from_slice(&sum.to_le_bytes());
        out
    }

    #[test]
    fn a_compression_bomb_and_lying_counts_are_refused() {
        // 16M records claimed in a few bytes: refused before anything is allocated for them.
        let bomb = forged(1 << 24, 0, &[(LZ4, lz4_flex::block::compress(&vec![0; 1 << 16]))]);
        assert!(matches!(decode(&bomb, &LIMITS), Err(WireError::TooLarge(_))));
        let over = Limits {
            max_records: 3,
            ..LIMITS
        };
        assert!(matches!(
            decode(&encode(b"", &cols()), &over),
            Err(WireError::TooLarge(_))
        ));
        // One record whose carrier count says 2 while one entry follows.
        let lying = forged(
            1,
            1,
            &[
                (RAW, 0u32.to_le_bytes().to_vec()),
                (RAW, 9u64.to_le_bytes().to_vec()),
                (RAW, 2u16.to_le_bytes().to_vec()),
                (RAW, 0u32.to_le_bytes().to_vec()),
                (RAW, vec![1]),
                (RAW, 5u64.to_le_bytes().to_vec()),
            ],
        );
        assert!(matches!(decode(&lying, &LIMITS), Err(WireError::Malformed(_))));
        // A parent further back than the first record reads as a parent vetting refuses.
        let far = forged(
            1,
            0,
            &[
                (RAW, 7u32.to_le_bytes().to_vec()),
                (RAW, 9u64.to_le_bytes().to_vec()),
                (RAW, 0u16.to_le_bytes().to_vec()),
                (RAW, vec![]),
                (RAW, vec![]),
                (RAW, vec![]),
            ],
        );
        assert!(decode(&far, &LIMITS).unwrap().1.parent[0] < -1);
        let unknown = forged(0, 0, &[(9, vec![])]);
        assert_eq!(
            decode(&unknown, &LIMITS),
            Err(WireError::Malformed("unknown section codec"))
        );
    }

    #[test]
    fn another_format_is_named_as_such() {
        let mut data = encode(b"", &cols());
        data[4] = 3;
        assert_eq!(decode(&data, &LIMITS), Err(WireError::UnknownFormat));
    }
}
