//! Frames: how messages are delimited on a byte stream.

/// Reads the varint at the start of `bytes` (postcard's encoding of an integer), if it is complete and
/// fits a `u64`.
pub fn peek_varint(bytes: &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for (i, &byte) in bytes.iter().take(10).enumerate() {
        let bits = u64::from(byte & 0x7f);
        let shift = 7 * i as u32;
        if shift == 63 && bits > 1 {
            return None;
        }
        value |= bits << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

/// Appends `value` as postcard writes a length: LEB128, seven bits a byte, low bits first.
pub fn push_varint(out: &mut Vec<u8>, mut value: u64) {
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}
