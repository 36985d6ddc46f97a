//! PyTorch's size classes (c10/cuda/CUDACachingAllocator.cpp), so the pool's
//! rounding, segment sizes and splitting match what a PyTorch user knows.

/// Every block is a multiple of this.
pub const MIN_BLOCK_SIZE: u64 = 512;
/// Requests up to this size come from the small pool.
pub const SMALL_SIZE: u64 = 1 << 20;
/// The small pool's segment size.
pub const SMALL_BUFFER: u64 = 2 << 20;
/// Segment size for large requests under [`MIN_LARGE_ALLOC`].
pub const LARGE_BUFFER: u64 = 20 << 20;
/// From this size a large request gets a segment of its own (rounded).
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Rounding of segments for requests of [`MIN_LARGE_ALLOC`] and more.
pub const ROUND_LARGE: u64 = 2 << 20;

/// The block size for a request of `bytes`.
pub fn round_size(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
}

pub fn is_small(size: u64) -> bool {
    size <= SMALL_SIZE
}

/// The segment to ask the device for when no cached block fits `size`.
pub fn segment_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

/// Whether a free block of `block` bytes serving `size` leaves a remainder
/// worth keeping as its own block.
pub fn should_split(small: bool, block: u64, size: u64) -> bool {
    let remaining = block - size;
    if small {
        remaining >= MIN_BLOCK_SIZE
    } else {
        remaining > SMALL_SIZE
    }
}
