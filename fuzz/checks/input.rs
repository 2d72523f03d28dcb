//! Reading a fuzz input as a sequence of choices: each read takes bytes from the front and,
//! once the input is used up, returns zeros, so every input is a valid (if short) case.

#![allow(dead_code)]

/// The unread part of a fuzz input.
pub(crate) struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub(crate) fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    pub(crate) fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    pub(crate) fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub(crate) fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    pub(crate) fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    /// A number below `n` (`n` > 0).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        usize::from(self.u16()) % n
    }

    /// One of `items`.
    pub(crate) fn pick<'b, T>(&mut self, items: &'b [T]) -> &'b T {
        &items[self.below(items.len())]
    }

    /// A u64 drawn to reach the edges often: small, near a power of two, or anything.
    pub(crate) fn edgy_u64(&mut self) -> u64 {
        match self.u8() % 4 {
            0 => u64::from(self.u8()),
            1 => u64::from(self.u16()),
            2 => {
                let shift = self.u8() % 64;
                (1u64 << shift)
                    .wrapping_add(u64::from(self.u8()) % 3)
                    .wrapping_sub(1)
            }
            _ => self.u64(),
        }
    }

    /// Up to `max` bytes, the length read first.
    pub(crate) fn bytes(&mut self, max: usize) -> &'a [u8] {
        let n = self.below(max + 1).min(self.data.len());
        let (taken, rest) = self.data.split_at(n);
        self.data = rest;
        taken
    }

    /// Bytes up to the next `sep` (not included) or the end.
    pub(crate) fn until(&mut self, sep: u8) -> &'a [u8] {
        let n = self
            .data
            .iter()
            .position(|&b| b == sep)
            .unwrap_or(self.data.len());
        let (taken, rest) = self.data.split_at(n);
        self.data = rest.get(1..).unwrap_or_default();
        taken
    }

    /// Everything left.
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
}
