use crate::category::Category;
use crate::controller::{MemoryController, MemoryError, Reservation, TableAccount};
use std::sync::Arc;

/// One counted, 16-byte-aligned block for the Arrow arrays of a flush batch (category
/// `batch_blocks`) or a delta snapshot for a scan (`scan_buffers`), freed whole.
///
/// The caller sizes it exactly (sum of its buffers, each rounded to 16 bytes), fills it
/// through [`BatchBlock::bytes_mut`], then shares it (`Arc`) as the owner of the Arrow buffers
/// that point into it; the memory and its `batch_blocks` budget go back when the last buffer
/// is dropped. Accounted bytes = requested bytes rounded up to 16.
pub struct BatchBlock {
    data: Box<[u128]>,
    _reservation: Reservation,
}

impl std::fmt::Debug for BatchBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchBlock").field("bytes", &self.len()).finish()
    }
}

impl BatchBlock {
    /// Reserves and allocates a zeroed block of at least `bytes` bytes.
    ///
    /// # Errors
    /// [`MemoryError`] when the budget cannot be had (nothing is allocated then).
    pub fn new(ctl: &Arc<MemoryController>, category: Category, table: Option<&TableAccount>, bytes: usize) -> Result<Self, MemoryError> {
        let words = bytes.div_ceil(16);
        let mut reservation = Reservation::new(ctl, category, table);
        reservation.try_grow(words * 16)?;
        Ok(Self { data: vec![0u128; words].into_boxed_slice(), _reservation: reservation })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.data.len() * 16
    }

    /// True when the block holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The block as bytes, for filling.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.data)
    }

    /// The block as bytes.
    pub fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.data)
    }
}
