//! The router's block keys: a content hash of each block's token IDs, chained from a namespace root.
//!
//! Engine block hashes cannot be reproduced outside the engine, so the router hashes token IDs itself
//! (as Dynamo and llm-d do) and keeps the engine hash only as an opaque per-carrier ID. Block `i`'s key
//! is `xxh3_64(tokens_le || extra, seed = key of block i-1)`, the first block seeded by the namespace
//! root: the key of a block names its whole prefix, so the trie is stored flat. Tokens are 4-byte
//! little-endian when every ID of the sequence fits in u32, else 8-byte two's complement for all of
//! them (nonsense for a vocabulary, but it must not crash and must never alias a u32 sequence).

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Names the key scheme: two routers' keys are comparable only when scheme and block size match.
pub const SCHEME: &str = "xxh3_64-chain-u32le/v1";

/// The chain seed of the plain namespace (no LoRA adapter, no cache salt).
pub const PLAIN_ROOT: u64 = xxhash_rust::const_xxh3::xxh3_64(b"routerfleet/block-key/v1");

pub fn plain_root() -> u64 {
    PLAIN_ROOT
}

fn pack_str_or_nil(out: &mut Vec<u8>, s: Option<&str>) {
    // msgpack, as every replica's encoder writes it: nil, or the shortest str form.
    let Some(s) = s else {
        out.push(0xc0);
        return;
    };
    crate::msgpack::str_header(out, s.len());
    out.extend_from_slice(s.as_bytes());
}

/// The chain seed of a namespace: the plain root, or the root hashed with `[lora_name, cache_salt]`
/// packed as msgpack, so salted or adapter blocks never match a plain request.
pub fn namespace_root(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    if lora_name.is_none() && cache_salt.is_none() {
        return plain_root();
    }
    let mut packed = vec![0x92];
    pack_str_or_nil(&mut packed, lora_name);
    pack_str_or_nil(&mut packed, cache_salt);
    xxh3_64_with_seed(&packed, plain_root())
}

/// Reads vLLM's cache salt out of a store's per-block extra keys, so its blocks key as SGLang's (and as
/// a request's `namespace_root(None, cache_salt)`): vLLM publishes, untagged, the cache salt on a
/// request's first block. `Some(salt)` (salt `None`: none) when every block's extras are exactly that
/// (`first` says the event starts at the root, where the salt goes); `None` when they hold anything
/// else (multimodal ids, prompt embeds) or the blocks are an adapter's: those stay hashed into their
/// blocks, which no request key reproduces, so they route cold. (vLLM picks an adapter by a request's
/// `model`, not by the `lora_name` field the router reads: keyed by name, a client could name an
/// adapter and be predicted its blocks.)
pub fn vllm_namespace(extra: &[Vec<u8>], lora_name: Option<&str>, first: bool) -> Option<Option<String>> {
    if lora_name.is_some() {
        return None;
    }
    let mut salt = None;
    for (i, entry) in extra.iter().enumerate() {
        if entry.is_empty() || entry.as_slice() == [0x90] {
            continue; // none, or an empty tuple
        }
        let (n, rest) = array_of(entry)?;
        if !(first && i == 0 && n == 1) {
            return None;
        }
        salt = Some(whole_str(rest)?);
    }
    Some(salt)
}

/// A fixarray's length and its items' bytes (the canonical form writes fixarrays up to 15 items).
fn array_of(entry: &[u8]) -> Option<(usize, &[u8])> {
    let (&head, rest) = entry.split_first()?;
    (head & 0xf0 == 0x90).then_some(((head & 0x0f) as usize, rest))
}

/// The string `bytes` holds, when they are one msgpack str and nothing else.
fn whole_str(bytes: &[u8]) -> Option<String> {
    let (&head, rest) = bytes.split_first()?;
    let (len, body) = match head {
        0xa0..=0xbf => ((head & 0x1f) as usize, rest),
        0xd9 => (*rest.first()? as usize, rest.get(1..)?),
        0xda => (
            u16::from_be_bytes([*rest.first()?, *rest.get(1)?]) as usize,
            rest.get(2..)?,
        ),
        _ => return None,
    };
    (body.len() == len)
        .then(|| String::from_utf8(body.to_vec()).ok())
        .flatten()
}

/// Token IDs as the key scheme reads them: u32 when they all fit, else i64 for the whole sequence.
#[derive(Clone)]
pub enum Tokens {
    U32(Vec<u32>),
    I64(Vec<i64>),
}

impl Tokens {
    pub fn from_i64(ids: &[i64]) -> Tokens {
        if ids.iter().all(|&t| (0..=u32::MAX as i64).contains(&t)) {
            Tokens::U32(ids.iter().map(|&t| t as u32).collect())
        } else {
            Tokens::I64(ids.to_vec())
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Tokens::U32(v) => v.len(),
            Tokens::I64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The little-endian bytes of tokens `[start, end)`, appended to `out`.
    fn bytes_into(&self, start: usize, end: usize, out: &mut Vec<u8>) {
        match self {
            Tokens::U32(v) => v[start..end]
                .iter()
                .for_each(|t| out.extend_from_slice(&t.to_le_bytes())),
            Tokens::I64(v) => v[start..end]
                .iter()
                .for_each(|t| out.extend_from_slice(&t.to_le_bytes())),
        }
    }
}

/// Walks the keys of a token sequence's full blocks one at a time (a trailing partial block is never
/// keyed: engines cache full blocks only), so a match that misses early hashes one block.
pub struct KeyChain<'a> {
    tokens: &'a Tokens,
    block_size: usize,
    extra: Option<&'a [Vec<u8>]>,
    parent: u64,
    next: usize,
    buf: Vec<u8>,
}

impl<'a> KeyChain<'a> {
    pub fn new(tokens: &'a Tokens, block_size: usize, root: u64, extra: Option<&'a [Vec<u8>]>) -> Self {
        KeyChain {
            tokens,
            block_size,
            extra,
            parent: root,
            next: 0,
            buf: Vec::with_capacity(block_size * 8),
        }
    }
}

impl Iterator for KeyChain<'_> {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        let bs = self.block_size;
        let start = self.next * bs;
        if bs == 0 || start + bs > self.tokens.len() {
            return None;
        }
        let extra = self.extra.and_then(|e| e.get(self.next)).filter(|x| !x.is_empty());
        self.parent = match (self.tokens, extra) {
            // The hot path: the u32 IDs are already their little-endian bytes in memory.
            #[cfg(target_endian = "little")]
            (Tokens::U32(v), None) => {
                let block = &v[start..start + bs];
                // SAFETY: any initialized u32 slice is a valid byte slice of 4x its length, with
                // the same lifetime; on a little-endian target those bytes are the LE encoding.
                let bytes = unsafe { std::slice::from_raw_parts(block.as_ptr().cast::<u8>(), block.len() * 4) };
                xxh3_64_with_seed(bytes, self.parent)
            }
            _ => {
                self.buf.clear();
                self.tokens.bytes_into(start, start + bs, &mut self.buf);
                if let Some(extra) = extra {
                    self.buf.extend_from_slice(extra);
                }
                xxh3_64_with_seed(&self.buf, self.parent)
            }
        };
        self.next += 1;
        Some(self.parent)
    }
}

/// Keys of every full block of `tokens`, chained from `root`; `extra[i]` (already canonical bytes)
/// is hashed into block `i`.
pub fn block_keys(tokens: &Tokens, block_size: usize, root: u64, extra: Option<&[Vec<u8>]>) -> Vec<u64> {
    KeyChain::new(tokens, block_size, root, extra).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_block_is_not_keyed() {
        let t = Tokens::from_i64(&[1, 2, 3, 4, 5]);
        assert_eq!(block_keys(&t, 2, plain_root(), None).len(), 2);
    }

    #[test]
    fn chain_names_the_prefix() {
        let a = block_keys(&Tokens::from_i64(&[1, 2, 3, 4]), 2, plain_root(), None);
        let b = block_keys(&Tokens::from_i64(&[9, 9, 3, 4]), 2, plain_root(), None);
        assert_ne!(a[1], b[1], "same block after a different prefix is a different key");
    }

    #[test]
    fn wide_ids_never_alias_u32() {
        let narrow = Tokens::from_i64(&[1, 0, 2, 0]);
        let wide = Tokens::from_i64(&[1, 2, -1, 0]);
        assert!(matches!(wide, Tokens::I64(_)));
        assert_ne!(
            block_keys(&narrow, 2, plain_root(), None)[0],
            block_keys(&wide, 2, plain_root(), None)[0]
        );
    }

    fn packed(items: &[&str]) -> Vec<u8> {
        let mut out = vec![0x90 | items.len() as u8];
        items.iter().for_each(|s| pack_str_or_nil(&mut out, Some(s)));
        out
    }

    #[test]
    fn vllms_salt_is_read_from_its_extra_keys() {
        let long = "s".repeat(40); // a str8 header
                                   // a salted request's first event: the salt on block 0, nothing on the others
        let extra = vec![packed(&[long.as_str()]), Vec::new(), vec![0x90]];
        assert_eq!(vllm_namespace(&extra, None, true), Some(Some(long.clone())));
        // a continuation (a parent): no block may carry a salt
        assert_eq!(vllm_namespace(&extra, None, false), None);
        assert_eq!(vllm_namespace(&[Vec::new(), vec![0x90]], None, false), Some(None));
        // anything else (two strings, a multimodal pair) keeps its extras
        assert_eq!(vllm_namespace(&[packed(&["a", "b"])], None, true), None);
        assert_eq!(
            vllm_namespace(&[vec![0x91, 0x92, 0xa2, b'i', b'd', 0x00]], None, true),
            None
        );
        // an adapter's blocks stay cold: vLLM picks adapters by `model`, which the router does not read
        assert_eq!(
            vllm_namespace(&[packed(&["adapter", "salt"])], Some("adapter"), true),
            None
        );
        assert_eq!(vllm_namespace(&[Vec::new()], Some("adapter"), true), None);
    }

    #[test]
    fn the_plain_root_is_the_hash_of_its_name() {
        assert_eq!(PLAIN_ROOT, xxhash_rust::xxh3::xxh3_64(b"routerfleet/block-key/v1"));
    }

    #[test]
    fn namespaces_are_disjoint() {
        let plain = namespace_root(None, None);
        assert_eq!(plain, plain_root());
        assert_ne!(namespace_root(Some("a"), None), namespace_root(None, Some("a")));
        assert_ne!(namespace_root(Some("a"), None), plain);
        let long = "x".repeat(300);
        assert_ne!(
            namespace_root(Some(&long), None),
            namespace_root(Some(&long[..299]), None)
        );
    }
}
