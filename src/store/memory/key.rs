//! A key as a slot keeps it: inline up to 23 bytes, else on the heap.

/// The longest key kept inside its slot; a longer one goes to the heap.
pub(super) const INLINE_KEY: usize = 23;

/// A key as a slot keeps it: up to 23 bytes in the slot itself (no allocation and no pointer to
/// follow when comparing), a longer one in a heap copy. 24 bytes either way: the length of an
/// inline key is a [`KeyLen`], whose unused values tell the heap case apart.
pub(super) enum Key {
    Inline {
        len: KeyLen,
        bytes: [u8; INLINE_KEY],
    },
    Heap(Box<str>),
}

impl Key {
    pub(super) fn new(key: &str) -> Self {
        let mut bytes = [0; INLINE_KEY];
        match (KeyLen::of(key.len()), bytes.get_mut(..key.len())) {
            (Some(len), Some(prefix)) => {
                prefix.copy_from_slice(key.as_bytes());
                Key::Inline { len, bytes }
            }
            _ => Key::Heap(key.into()),
        }
    }

    /// Whether this is `key`; an inline key is compared in place, without a call to `memcmp`.
    #[inline]
    pub(super) fn is(&self, key: &[u8]) -> bool {
        match self {
            Key::Inline { len, bytes } => {
                *len as usize == key.len() && bytes.iter().zip(key).all(|(a, b)| a == b)
            }
            Key::Heap(own) => own.as_bytes() == key,
        }
    }

    #[inline]
    pub(super) fn as_bytes(&self) -> &[u8] {
        match self {
            Key::Inline { len, bytes } => bytes.get(..*len as usize).unwrap_or_default(),
            Key::Heap(key) => key.as_bytes(),
        }
    }
}

/// The length of an inline key, 0 to 23.
#[derive(Clone, Copy)]
#[repr(u8)]
#[rustfmt::skip]
pub(super) enum KeyLen {
    L0, L1, L2, L3, L4, L5, L6, L7, L8, L9, L10, L11,
    L12, L13, L14, L15, L16, L17, L18, L19, L20, L21, L22, L23,
}

impl KeyLen {
    #[rustfmt::skip]
    const ALL: [KeyLen; INLINE_KEY + 1] = {
        use KeyLen::*;
        [
            L0, L1, L2, L3, L4, L5, L6, L7, L8, L9, L10, L11,
            L12, L13, L14, L15, L16, L17, L18, L19, L20, L21, L22, L23,
        ]
    };

    fn of(len: usize) -> Option<Self> {
        Self::ALL.get(len).copied()
    }
}
