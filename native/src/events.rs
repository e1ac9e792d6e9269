//! KV events as the index applies them: the dialect-neutral shapes every engine dialect decodes into,
//! and the index's rule for which stores it can take (`store_skip`).

use crate::keys::Tokens;

/// Tier bits: where a carrier holds a block. One carrier may hold a block in several tiers; the
/// slot of a tier (its bit index) orders them best first.
pub const DEVICE: u8 = 1;
pub const HOST: u8 = 2;
pub const DISK: u8 = 4;
pub const EXTERNAL: u8 = 8;
pub const ALL_TIERS: u8 = 0xF;

/// Storage media from both engines' vocabularies. An untagged store means DEVICE; an unknown medium
/// on a store is skipped, and on a remove clears every tier (docs/kv-wire.md, section 3.2).
pub const MEDIUM_TIERS: [(&str, u8); 6] = [
    ("GPU", DEVICE),
    ("CPU", HOST),
    ("CPU_PINNED", HOST),
    ("STORAGE", DISK),
    ("DISK", DISK),
    ("EXTERNAL", EXTERNAL),
];

/// A medium's name: borrowed from `MEDIUM_TIERS` when it is a known one (no allocation per event).
pub type Medium = std::borrow::Cow<'static, str>;

/// The medium named `name`, interned when known.
pub fn medium(name: &str) -> Medium {
    match MEDIUM_TIERS.iter().find(|(m, _)| *m == name) {
        Some(&(m, _)) => Medium::Borrowed(m),
        None => Medium::Owned(name.to_owned()),
    }
}

pub fn medium_tier(medium: &str) -> Option<u8> {
    MEDIUM_TIERS.iter().find(|(m, _)| *m == medium).map(|&(_, t)| t)
}

#[derive(Clone)]
pub struct Stored {
    pub block_hashes: Vec<u64>,
    pub parent_block_hash: Option<u64>,
    pub tokens: Tokens,
    pub block_size: i64,
    pub medium: Option<Medium>,
    /// Carried for the event's own shape only: the key namespace is the LoRA name.
    pub lora_id: Option<i64>,
    pub lora_name: Option<String>,
    /// Canonical bytes of each block's opaque extra keys (empty for a block without); None: none sent.
    pub extra_keys: Option<Vec<Vec<u8>>>,
    pub cache_salt: Option<String>,
    pub group_idx: Option<i64>,
    pub kv_cache_spec_kind: Option<String>,
}

impl Stored {
    /// A device-tier store with every optional field empty (tests build events with it).
    pub fn plain(block_hashes: &[u64], parent: Option<u64>, tokens: &[i64], block_size: i64) -> Stored {
        Stored {
            block_hashes: block_hashes.to_vec(),
            parent_block_hash: parent,
            tokens: Tokens::from_i64(tokens),
            block_size,
            medium: None,
            lora_id: None,
            lora_name: None,
            extra_keys: None,
            cache_salt: None,
            group_idx: None,
            kv_cache_spec_kind: None,
        }
    }
}

#[derive(Clone)]
pub struct Removed {
    pub block_hashes: Vec<u64>,
    pub medium: Option<Medium>,
    pub group_idx: Option<i64>,
}

#[derive(Clone)]
pub enum Event {
    Stored(Stored),
    Removed(Removed),
    AllCleared,
}

/// Why an event (or some of its blocks) was not indexed; `as_str` is the metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Skip {
    BlockSizeMismatch = 0,
    UnknownParent,
    UnknownMedium,
    OtherGroup,
    TokenCount,
    /// A remove for a block this carrier never announced.
    UnknownBlock,
}

impl Skip {
    pub const ALL: [Skip; 6] = [
        Skip::BlockSizeMismatch,
        Skip::UnknownParent,
        Skip::UnknownMedium,
        Skip::OtherGroup,
        Skip::TokenCount,
        Skip::UnknownBlock,
    ];

    /// A refusal that means "this router is configured differently from the engine", not a bad
    /// event or a prefix we joined after: what the fit tally counts.
    pub fn is_config(self) -> bool {
        matches!(self, Skip::BlockSizeMismatch | Skip::OtherGroup | Skip::UnknownMedium)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Skip::BlockSizeMismatch => "block_size_mismatch",
            Skip::UnknownParent => "unknown_parent",
            Skip::UnknownMedium => "unknown_medium",
            Skip::OtherGroup => "other_group",
            Skip::TokenCount => "token_count",
            Skip::UnknownBlock => "unknown_block",
        }
    }
}

/// Why a store cannot be indexed under this configuration, before the trie is consulted (the parent
/// check needs it); None: it can. The fit tally applies the same rule to tell a configuration
/// mismatch from an empty cache.
pub fn store_skip(ev: &Stored, block_size: i64, full_attention_group: i64) -> Option<Skip> {
    if ev.medium.as_deref().is_some_and(|m| medium_tier(m).is_none()) {
        return Some(Skip::UnknownMedium);
    }
    let other_kind = !matches!(ev.kv_cache_spec_kind.as_deref(), None | Some("full_attention"));
    if other_kind || ev.group_idx.is_some_and(|g| g != full_attention_group) {
        return Some(Skip::OtherGroup);
    }
    if ev.block_size != block_size {
        return Some(Skip::BlockSizeMismatch);
    }
    if ev.tokens.len() as u128 != ev.block_hashes.len() as u128 * block_size.max(0) as u128 {
        return Some(Skip::TokenCount);
    }
    None
}
