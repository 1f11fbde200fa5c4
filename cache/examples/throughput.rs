//! Measures what the cache's design rests on, on this machine: BLAKE3 throughput (one thread and
//! chunked over every core, per chunk size), each codec's ratio and speed on random bytes, zeros
//! and synthetic weights, the encoder's own choices, and the store's write and read rates.
//!
//! `cargo run --release -p gleam-cache --example throughput [MiB]` (default 256 MiB of data for
//! hashing and the store, a quarter of it for the codecs). Figures are one pass each; run twice.

use std::time::Instant;

use gleam_cache::{BlobStore, Codec, Compression, ContentId, Decoder, Encoder, Manifest};

const MIB: usize = 1 << 20;

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(256);
    let len = mib * MIB;
    println!(
        "cores: {}",
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
    );

    let weights = fp16_weights(len / 2);
    println!("\n## BLAKE3 over {mib} MiB");
    let (secs, _) = time(|| blake3::hash(&weights));
    println!("blake3::hash, one thread: {:.2} GB/s", gbps(len, secs));
    for chunk_mib in [1, 4, 8, 16] {
        let (secs, m) = time(|| Manifest::with_chunk_size(&weights, (chunk_mib * MIB) as u32));
        println!(
            "Manifest, {chunk_mib:>2} MiB chunks ({} chunks), all cores: {:.2} GB/s",
            m.chunks().len(),
            gbps(len, secs)
        );
    }

    let codec_len = (len / 4).max(8 * MIB);
    let sets: [(&str, Vec<u8>); 5] = [
        ("random bytes", noise(codec_len)),
        ("zeros", vec![0; codec_len]),
        ("fp16 ~N(0,0.02)", fp16_weights(codec_len / 2)),
        ("bf16 ~N(0,0.02)", bf16_weights(codec_len / 2)),
        ("fp32 ~N(0,0.02)", fp32_weights(codec_len / 4)),
    ];
    println!(
        "\n## Codecs, {} MiB in 8 MiB chunks, one thread (decode includes BLAKE3 verification)",
        codec_len / MIB
    );
    println!("| data | codec | ratio | encode MB/s | decode+verify MB/s |");
    println!("|---|---|---|---|---|");
    for (name, data) in &sets {
        let chunks: Vec<&[u8]> = data.chunks(8 * MIB).collect();
        let ids: Vec<ContentId> = chunks.iter().map(|c| ContentId::of(c)).collect();
        let rows = [
            Some(Codec::Zstd),
            Some(Codec::Shuffle2Zstd),
            Some(Codec::Shuffle4Zstd),
            None,
        ];
        for forced in rows {
            let label = forced.map_or("auto (Encoder::encode)".into(), |c| format!("{c:?} L1"));
            // Encoding is timed without building a wire buffer: a raw chunk stays borrowed.
            let mut encoder = Encoder::new(Compression::default());
            let (enc_secs, wire) = time(|| {
                chunks
                    .iter()
                    .map(|c| match forced {
                        Some(codec) => encoder.encode_as(c, codec).wire_len(),
                        None => encoder.encode(c).wire_len(),
                    })
                    .sum::<usize>()
            });
            let encoded: Vec<Vec<u8>> = chunks
                .iter()
                .map(|c| match forced {
                    Some(codec) => encoder.encode_as(c, codec).to_wire(),
                    None => encoder.encode(c).to_wire(),
                })
                .collect();
            let mut decoder = Decoder::new();
            let mut out = vec![0u8; 8 * MIB];
            let (dec_secs, ()) = time(|| {
                for ((w, id), c) in encoded.iter().zip(&ids).zip(&chunks) {
                    decoder.decode_into(id, w, &mut out[..c.len()]).unwrap();
                }
            });
            let codecs: Vec<String> = encoded
                .iter()
                .map(|w| format!("{:?}", Codec::from_tag(w[0]).unwrap()))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            println!(
                "| {name} | {label} -> {} | {:.3} | {:.0} | {:.0} |",
                codecs.join("+"),
                data.len() as f64 / wire as f64,
                mbps(data.len(), enc_secs),
                mbps(data.len(), dec_secs)
            );
        }
    }

    println!("\n## Store ({mib} MiB payload of fp16 weights, 8 MiB chunks, under $TMPDIR)");
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::open(dir.path(), 4 * len as u64).unwrap();
    let (secs, manifest) = time(|| store.put_payload(&weights).unwrap());
    println!(
        "put_payload (hash, write, fsync, rename; all cores): {:.2} GB/s",
        gbps(len, secs)
    );
    let mut dst = vec![0u8; len];
    let (secs, missing) = time(|| store.read_payload(&manifest, &mut dst).unwrap());
    assert!(missing.is_empty() && dst == weights);
    println!(
        "read_payload (read, verify; all cores, page cache warm), into fresh memory: {:.2} GB/s",
        gbps(len, secs)
    );
    // Again into the same buffer, its pages resident now: the serving peer's pooled staging buffers.
    let (secs, missing) = time(|| store.read_payload(&manifest, &mut dst).unwrap());
    assert!(missing.is_empty() && dst == weights);
    println!(
        "read_payload (read, verify; all cores, page cache warm), into resident memory: {:.2} GB/s",
        gbps(len, secs)
    );
    let (secs, plan) = time(|| store.plan(&manifest));
    assert!(plan.is_complete());
    println!(
        "plan of {} chunks: {:.0} µs",
        manifest.chunks().len(),
        secs * 1e6
    );
    let small: Vec<Vec<u8>> = (0..200u32).map(|i| i.to_le_bytes().repeat(1024)).collect();
    let (secs, ()) = time(|| {
        for blob in &small {
            store.put(blob).unwrap();
        }
    });
    println!("put of a 4 KiB blob: {:.0} µs each", secs * 1e6 / 200.0);
    let (secs, ()) = time(|| {
        for blob in &small {
            assert!(store.get(&ContentId::of(blob)).unwrap().is_some());
        }
    });
    println!("get of a 4 KiB blob: {:.1} µs each", secs * 1e6 / 200.0);
    let (secs, _) = time(|| BlobStore::open(dir.path(), 4 * len as u64).unwrap());
    println!("open: {:.0} µs", secs * 1e6);
}

fn time<T>(f: impl FnOnce() -> T) -> (f64, T) {
    let start = Instant::now();
    let out = f();
    (start.elapsed().as_secs_f64(), out)
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn mbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e6
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn normal(&mut self, sigma: f64) -> f64 {
        let u = |x: u64| ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let (a, b) = (u(self.next()), u(self.next()));
        sigma * (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
    }
}

fn noise(len: usize) -> Vec<u8> {
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&rng.next().to_le_bytes());
    }
    out.truncate(len);
    out
}

fn fp16_weights(n: usize) -> Vec<u8> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .flat_map(|_| half::f16::from_f64(rng.normal(0.02)).to_le_bytes())
        .collect()
}

fn bf16_weights(n: usize) -> Vec<u8> {
    let mut rng = Rng(0x1234_5678_9ABC_DEF1);
    (0..n)
        .flat_map(|_| half::bf16::from_f64(rng.normal(0.02)).to_le_bytes())
        .collect()
}

fn fp32_weights(n: usize) -> Vec<u8> {
    let mut rng = Rng(0x0F0F_1234_ABCD_9876);
    (0..n)
        .flat_map(|_| (rng.normal(0.02) as f32).to_le_bytes())
        .collect()
}
