//! Just enough MessagePack for KV event payloads: a validating pass over the whole payload, then a
//! zero-copy reader over bytes known to be well formed.
//!
//! The validation pass finds every msgpack-level fault in stream order, as an unpacker would, before
//! any field is read: truncation, reserved bytes, invalid UTF-8, lengths over our bounds or over what
//! the payload could hold, nesting, map keys that contain maps (no hashable key), trailing bytes.
//! Nothing is allocated for it, and a forged 4G-element header costs nothing.

use crate::decode::Reason;

/// Per-value bounds (a value over them is `TooLarge`).
#[derive(Clone, Copy)]
pub struct Limits {
    pub max_array: u64,
    pub max_map: u64,
    pub max_str: u64,
    pub max_bin: u64,
    pub max_ext: u64,
    pub max_depth: usize,
}

/// One value's header as the reader meets it. Containers are headers only: their elements follow.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Head<'a> {
    Nil,
    Bool(bool),
    /// A non-negative int (every msgpack uint, and non-negative ints written signed).
    UInt(u64),
    /// A negative int.
    NInt(i64),
    Float(f64),
    Str(&'a str),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    Ext(i8, &'a [u8]),
}

struct Raw {
    kind: u8, // 0 scalar, 1 str, 2 bin, 3 ext, 4 array, 5 map
    len: u64, // payload bytes (str/bin/ext) or elements (array/map)
    header: usize,
}

/// The header at `buf[pos..]`, without bounds on lengths. Err(Truncated) when the header itself is cut.
#[inline(always)]
fn raw(buf: &[u8], pos: usize) -> Result<Raw, Reason> {
    let b = *buf.get(pos).ok_or(Reason::Truncated)?;
    let be = |n: usize| -> Result<u64, Reason> {
        let s = buf.get(pos + 1..pos + 1 + n).ok_or(Reason::Truncated)?;
        Ok(s.iter().fold(0u64, |acc, &x| acc << 8 | x as u64))
    };
    let scalar = |extra: usize| -> Result<Raw, Reason> {
        if buf.len() < pos + 1 + extra {
            return Err(Reason::Truncated);
        }
        Ok(Raw {
            kind: 0,
            len: 0,
            header: 1 + extra,
        })
    };
    Ok(match b {
        0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => scalar(0)?,
        0x80..=0x8f => Raw {
            kind: 5,
            len: (b & 0x0f) as u64,
            header: 1,
        },
        0x90..=0x9f => Raw {
            kind: 4,
            len: (b & 0x0f) as u64,
            header: 1,
        },
        0xa0..=0xbf => Raw {
            kind: 1,
            len: (b & 0x1f) as u64,
            header: 1,
        },
        0xc1 => return Err(Reason::NotMsgpack),
        0xc4 => Raw {
            kind: 2,
            len: be(1)?,
            header: 2,
        },
        0xc5 => Raw {
            kind: 2,
            len: be(2)?,
            header: 3,
        },
        0xc6 => Raw {
            kind: 2,
            len: be(4)?,
            header: 5,
        },
        0xc7 => Raw {
            kind: 3,
            len: be(1)?,
            header: 3,
        },
        0xc8 => Raw {
            kind: 3,
            len: be(2)?,
            header: 4,
        },
        0xc9 => Raw {
            kind: 3,
            len: be(4)?,
            header: 6,
        },
        0xca => scalar(4)?,
        0xcb => scalar(8)?,
        0xcc | 0xd0 => scalar(1)?,
        0xcd | 0xd1 => scalar(2)?,
        0xce | 0xd2 => scalar(4)?,
        0xcf | 0xd3 => scalar(8)?,
        0xd4 => Raw {
            kind: 3,
            len: 1,
            header: 2,
        },
        0xd5 => Raw {
            kind: 3,
            len: 2,
            header: 2,
        },
        0xd6 => Raw {
            kind: 3,
            len: 4,
            header: 2,
        },
        0xd7 => Raw {
            kind: 3,
            len: 8,
            header: 2,
        },
        0xd8 => Raw {
            kind: 3,
            len: 16,
            header: 2,
        },
        0xd9 => Raw {
            kind: 1,
            len: be(1)?,
            header: 2,
        },
        0xda => Raw {
            kind: 1,
            len: be(2)?,
            header: 3,
        },
        0xdb => Raw {
            kind: 1,
            len: be(4)?,
            header: 5,
        },
        0xdc => Raw {
            kind: 4,
            len: be(2)?,
            header: 3,
        },
        0xdd => Raw {
            kind: 4,
            len: be(4)?,
            header: 5,
        },
        0xde => Raw {
            kind: 5,
            len: be(2)?,
            header: 3,
        },
        0xdf => Raw {
            kind: 5,
            len: be(4)?,
            header: 5,
        },
    })
}

struct Frame {
    left: u64, // elements still to read; a map counts its keys and values separately
    is_map: bool,
    in_key: bool, // this container is (inside) a map key
}

/// Validate that `buf` holds exactly one well-formed value within `limits`.
fn validate(buf: &[u8], limits: &Limits) -> Result<(), Reason> {
    let n = buf.len() as u64;
    let mut stack: Vec<Frame> = Vec::new();
    let mut pos = 0usize;
    loop {
        // Does the next value sit in a map key (its own, or an enclosing one)?
        let in_key = stack.last().is_some_and(|f| f.in_key || (f.is_map && f.left % 2 == 0));
        let r = raw(buf, pos)?;
        let body = pos + r.header;
        match r.kind {
            1..=3 => {
                let bound = [limits.max_str, limits.max_bin, limits.max_ext][r.kind as usize - 1];
                if r.len > bound {
                    return Err(Reason::TooLarge);
                }
                let end = body as u64 + r.len;
                if end > n {
                    return Err(Reason::Truncated);
                }
                let data = &buf[body..end as usize];
                if r.kind == 1 && !data.is_ascii() && std::str::from_utf8(data).is_err() {
                    return Err(Reason::NotMsgpack);
                }
                // The timestamp extension (-1) has three sizes; an unpacker refuses any other.
                if r.kind == 3 && buf[body - 1] == 0xff && ![4, 8, 12].contains(&r.len) {
                    return Err(Reason::NotMsgpack);
                }
                pos = end as usize;
            }
            4 | 5 => {
                let is_map = r.kind == 5;
                let bound = if is_map { limits.max_map } else { limits.max_array };
                // Every element takes at least a byte: a length the payload cannot hold is a cut one.
                if r.len > bound.min(n) {
                    return Err(if r.len > bound {
                        Reason::TooLarge
                    } else {
                        Reason::Truncated
                    });
                }
                if is_map && in_key {
                    return Err(Reason::BadType); // a map can never be part of a hashable key
                }
                if stack.len() >= limits.max_depth {
                    return Err(Reason::NotMsgpack);
                }
                pos = body;
                if r.len > 0 {
                    stack.push(Frame {
                        left: if is_map { r.len * 2 } else { r.len },
                        is_map,
                        in_key,
                    });
                    continue;
                }
            }
            _ => pos = body,
        }
        // A value is complete: count it in its container; a container filled is complete in turn.
        loop {
            let Some(f) = stack.last_mut() else {
                return if pos < buf.len() {
                    Err(Reason::TrailingData)
                } else {
                    Ok(())
                };
            };
            f.left -= 1;
            if f.left > 0 {
                break;
            }
            stack.pop();
        }
    }
}

/// A payload `validate` accepted: the only way to get a `Reader`.
#[derive(Clone, Copy)]
pub struct Validated<'a>(&'a [u8]);

/// Validate `buf` (see `validate`) into the form a `Reader` reads.
pub fn validated<'a>(buf: &'a [u8], limits: &Limits) -> Result<Validated<'a>, Reason> {
    validate(buf, limits).map(|()| Validated(buf))
}

/// Reads validated bytes. It never panics; reading past the end yields `Nil`.
pub struct Reader<'a> {
    buf: &'a [u8],
    pub pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(v: Validated<'a>) -> Self {
        Reader { buf: v.0, pos: 0 }
    }

    #[inline(always)]
    fn be(&self, at: usize, n: usize) -> u64 {
        let Some(s) = self.buf.get(at..at + n) else { return 0 };
        match n {
            1 => s[0] as u64,
            2 => u16::from_be_bytes([s[0], s[1]]) as u64,
            4 => u32::from_be_bytes([s[0], s[1], s[2], s[3]]) as u64,
            _ => s.iter().fold(0u64, |acc, &x| acc << 8 | x as u64),
        }
    }

    #[inline(always)]
    fn data(&mut self, at: usize, n: u64) -> &'a [u8] {
        let end = (at as u64).saturating_add(n).min(self.buf.len() as u64) as usize;
        self.pos = end;
        self.buf.get(at..end).unwrap_or(&[])
    }

    #[inline(always)]
    fn str(&mut self, at: usize, n: u64) -> Head<'a> {
        let d = self.data(at, n);
        // SAFETY: `validate` checked every string of this buffer is UTF-8, and `at..at+n` is exactly
        // one such string (the reader only moves from value to value).
        Head::Str(unsafe { std::str::from_utf8_unchecked(d) })
    }

    /// The next value's header; advances past it (and past a scalar's, string's or binary's data).
    #[inline]
    pub fn head(&mut self) -> Head<'a> {
        let p = self.pos;
        let Some(&b) = self.buf.get(p) else { return Head::Nil };
        self.pos = p + 1;
        match b {
            0x00..=0x7f => Head::UInt(b as u64),
            0xe0..=0xff => Head::NInt((b as i8) as i64),
            0x80..=0x8f => Head::Map((b & 0x0f) as u32),
            0x90..=0x9f => Head::Array((b & 0x0f) as u32),
            0xa0..=0xbf => self.str(p + 1, (b & 0x1f) as u64),
            0xc0 | 0xc1 => Head::Nil,
            0xc2 => Head::Bool(false),
            0xc3 => Head::Bool(true),
            0xc4 => Head::Bin(self.data(p + 2, self.be(p + 1, 1))),
            0xc5 => Head::Bin(self.data(p + 3, self.be(p + 1, 2))),
            0xc6 => Head::Bin(self.data(p + 5, self.be(p + 1, 4))),
            0xc7 => Head::Ext(self.be(p + 2, 1) as i8, self.data(p + 3, self.be(p + 1, 1))),
            0xc8 => Head::Ext(self.be(p + 3, 1) as i8, self.data(p + 4, self.be(p + 1, 2))),
            0xc9 => Head::Ext(self.be(p + 5, 1) as i8, self.data(p + 6, self.be(p + 1, 4))),
            0xca => {
                self.pos = p + 5;
                Head::Float(f32::from_bits(self.be(p + 1, 4) as u32) as f64)
            }
            0xcb => {
                self.pos = p + 9;
                Head::Float(f64::from_bits(self.be(p + 1, 8)))
            }
            0xcc..=0xd3 => {
                let n = 1usize << (b & 0x03);
                self.pos = p + 1 + n;
                let v = self.be(p + 1, n);
                if b <= 0xcf {
                    return Head::UInt(v);
                }
                // Sign-extend an n-byte two's complement value.
                let shift = 64 - 8 * n as u32;
                match ((v << shift) as i64) >> shift {
                    x if x < 0 => Head::NInt(x),
                    x => Head::UInt(x as u64),
                }
            }
            0xd4..=0xd8 => Head::Ext(self.be(p + 1, 1) as i8, self.data(p + 2, 1u64 << (b - 0xd4))),
            0xd9 => self.str(p + 2, self.be(p + 1, 1)),
            0xda => self.str(p + 3, self.be(p + 1, 2)),
            0xdb => self.str(p + 5, self.be(p + 1, 4)),
            0xdc => {
                self.pos = p + 3;
                Head::Array(self.be(p + 1, 2) as u32)
            }
            0xdd => {
                self.pos = p + 5;
                Head::Array(self.be(p + 1, 4) as u32)
            }
            0xde => {
                self.pos = p + 3;
                Head::Map(self.be(p + 1, 2) as u32)
            }
            0xdf => {
                self.pos = p + 5;
                Head::Map(self.be(p + 1, 4) as u32)
            }
        }
    }

    /// Skip one whole value.
    pub fn skip(&mut self) {
        let mut left: u64 = 1;
        while left > 0 && self.pos < self.buf.len() {
            left -= 1;
            match self.head() {
                Head::Array(n) => left += n as u64,
                Head::Map(n) => left += 2 * n as u64,
                _ => {}
            }
        }
    }
}

/// Appends the shortest msgpack str header for `n` bytes.
pub fn str_header(out: &mut Vec<u8>, n: usize) {
    if n < 32 {
        out.push(0xa0 | n as u8);
    } else if n < 1 << 8 {
        out.extend_from_slice(&[0xd9, n as u8]);
    } else if n < 1 << 16 {
        out.push(0xda);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

/// Appends the canonical encoding of the value at `r` to `out`, as an encoder of the decoded value
/// writes it: shortest int, str and container forms, floats as float64, and maps frozen into arrays of
/// `[key, value]` pairs (a map is not a hashable key part). Returns (depth, whether a map was met).
pub fn canonical(r: &mut Reader<'_>, out: &mut Vec<u8>) -> (usize, bool) {
    // Shortest array header: fixarray, then 16-bit, 32-bit (msgpack has no 8-bit array).
    fn array_header(out: &mut Vec<u8>, n: u32) {
        if n < 16 {
            out.push(0x90 | n as u8);
        } else if n < 1 << 16 {
            out.push(0xdc);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            out.push(0xdd);
            out.extend_from_slice(&n.to_be_bytes());
        }
    }
    fn int(out: &mut Vec<u8>, v: i128) {
        // i128 holds every msgpack int, so one ladder writes both signs.
        if (0..128).contains(&v) {
            out.push(v as u8);
        } else if (-32..0).contains(&v) {
            out.push(v as i8 as u8);
        } else if v > 0 {
            if v < 1 << 8 {
                out.extend_from_slice(&[0xcc, v as u8]);
            } else if v < 1 << 16 {
                out.push(0xcd);
                out.extend_from_slice(&(v as u16).to_be_bytes());
            } else if v < 1 << 32 {
                out.push(0xce);
                out.extend_from_slice(&(v as u32).to_be_bytes());
            } else {
                out.push(0xcf);
                out.extend_from_slice(&(v as u64).to_be_bytes());
            }
        } else if v >= -(1 << 7) {
            out.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= -(1 << 15) {
            out.push(0xd1);
            out.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= -(1 << 31) {
            out.push(0xd2);
            out.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            out.push(0xd3);
            out.extend_from_slice(&(v as i64).to_be_bytes());
        }
    }
    match r.head() {
        Head::Nil => out.push(0xc0),
        Head::Bool(b) => out.push(if b { 0xc3 } else { 0xc2 }),
        Head::UInt(v) => int(out, v as i128),
        Head::NInt(v) => int(out, v as i128),
        Head::Float(f) => {
            out.push(0xcb);
            out.extend_from_slice(&f.to_bits().to_be_bytes());
        }
        Head::Str(s) => {
            str_header(out, s.len());
            out.extend_from_slice(s.as_bytes());
        }
        Head::Bin(b) => {
            let n = b.len();
            if n < 1 << 8 {
                out.extend_from_slice(&[0xc4, n as u8]);
            } else if n < 1 << 16 {
                out.push(0xc5);
                out.extend_from_slice(&(n as u16).to_be_bytes());
            } else {
                out.push(0xc6);
                out.extend_from_slice(&(n as u32).to_be_bytes());
            }
            out.extend_from_slice(b);
        }
        Head::Ext(t, d) => {
            match d.len() {
                1 => out.push(0xd4),
                2 => out.push(0xd5),
                4 => out.push(0xd6),
                8 => out.push(0xd7),
                16 => out.push(0xd8),
                n if n < 1 << 8 => out.extend_from_slice(&[0xc7, n as u8]),
                n if n < 1 << 16 => {
                    out.push(0xc8);
                    out.extend_from_slice(&(n as u16).to_be_bytes());
                }
                n => {
                    out.push(0xc9);
                    out.extend_from_slice(&(n as u32).to_be_bytes());
                }
            }
            out.push(t as u8);
            out.extend_from_slice(d);
        }
        Head::Array(n) => {
            array_header(out, n);
            let (mut depth, mut map) = (0, false);
            for _ in 0..n {
                let (d, m) = canonical(r, out);
                depth = depth.max(d);
                map |= m;
            }
            return (depth + 1, map);
        }
        Head::Map(n) => {
            array_header(out, n);
            let mut depth = 0;
            for _ in 0..n {
                out.push(0x92);
                let (dk, _) = canonical(r, out);
                let (dv, _) = canonical(r, out);
                depth = depth.max(dk).max(dv);
            }
            return (depth + 1, true);
        }
    }
    (0, false)
}
