//! `gleam cache`: look at or empty this device's content cache, `<config dir>/cache`, where a
//! serving peer keeps the weights and modules its clients sent, so they need not be sent again.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use gleam_cache::{BlobStore, DEFAULT_LIMIT, Stats};

/// `gleam cache [--config-dir DIR] COMMAND`.
pub type Args = super::WithConfigDir<Command>;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Show what the cache holds and how it has served: blobs, size against the limit, hits,
    /// misses, corrupt blobs dropped, evictions.
    Stats {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Remove every cached blob and reset the counters (the size limit stays). Sessions being
    /// served keep working; what they need is fetched from their clients again.
    Clear,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let super::WithConfigDir { config, command } = args;
    let dir = config.path()?.join("cache");
    match command {
        Command::Stats { json } => {
            let stats = stats(&dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&to_json(&dir, &stats))?);
            } else {
                println!("{}", table(&dir, &stats));
            }
        }
        Command::Clear => match clear(&dir)? {
            Some(cleared) => println!(
                "removed {} blobs ({}) from {}",
                cleared.blobs,
                size(cleared.bytes),
                dir.display()
            ),
            None => println!("no content cache at {}: nothing to clear", dir.display()),
        },
    }
    Ok(ExitCode::SUCCESS)
}

/// The store's figures; those of an empty store if there is none yet (without creating it: a look
/// should not leave a directory behind).
fn stats(dir: &Path) -> anyhow::Result<Stats> {
    if !dir.exists() {
        return Ok(Stats {
            blobs: 0,
            bytes: 0,
            limit: DEFAULT_LIMIT,
            hits: 0,
            misses: 0,
            corrupt: 0,
            evicted: 0,
        });
    }
    Ok(open(dir)?.stats()?)
}

fn clear(dir: &Path) -> anyhow::Result<Option<gleam_cache::Cleared>> {
    if !dir.exists() {
        return Ok(None);
    }
    Ok(Some(open(dir)?.clear()?))
}

fn open(dir: &Path) -> anyhow::Result<BlobStore> {
    BlobStore::open_recorded(dir)
        .with_context(|| format!("opening the content cache in {}", dir.display()))
}

fn to_json(dir: &Path, s: &Stats) -> serde_json::Value {
    serde_json::json!({
        "dir": PathBuf::from(dir),
        "blobs": s.blobs,
        "bytes": s.bytes,
        "limit": s.limit,
        "hits": s.hits,
        "misses": s.misses,
        "corrupt": s.corrupt,
        "evicted": s.evicted,
    })
}

fn table(dir: &Path, s: &Stats) -> Table {
    let mut table = Table::new();
    table.load_style(UTF8_FULL_CONDENSED);
    table.set_header(["CONTENT CACHE", ""]);
    let used = if s.limit == 0 {
        String::new()
    } else {
        format!(
            " ({:.0}% of the limit)",
            s.bytes as f64 * 100.0 / s.limit as f64
        )
    };
    let reads = s.hits + s.misses;
    let hit_rate = if reads == 0 {
        "-".to_owned()
    } else {
        format!("{:.1}%", s.hits as f64 * 100.0 / reads as f64)
    };
    let rows = [
        ("directory", dir.display().to_string()),
        ("blobs", s.blobs.to_string()),
        ("size", format!("{}{used}", size(s.bytes))),
        ("limit", size(s.limit)),
        ("hits", s.hits.to_string()),
        ("misses", s.misses.to_string()),
        ("hit rate", hit_rate),
        ("corrupt, dropped", s.corrupt.to_string()),
        ("evicted", s.evicted.to_string()),
    ];
    for (name, value) in rows {
        table.add_row([name.to_owned(), value]);
    }
    table
}

/// Bytes in binary units, three significant figures.
fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    let decimals = if value < 10.0 {
        2
    } else if value < 100.0 {
        1
    } else {
        0
    };
    format!("{value:.decimals$} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_naturally() {
        assert_eq!(size(0), "0 B");
        assert_eq!(size(1023), "1023 B");
        assert_eq!(size(1536), "1.50 KiB");
        assert_eq!(size(64 << 30), "64.0 GiB");
        assert_eq!(size(300 << 20), "300 MiB");
    }

    #[test]
    fn stats_and_clear_read_the_store_other_processes_use() {
        let temp = tempfile::tempdir().unwrap();
        let dir = temp.path().join("cache");
        // No cache yet: empty figures, nothing created.
        assert_eq!(stats(&dir).unwrap().blobs, 0);
        assert!(clear(&dir).unwrap().is_none());
        assert!(!dir.exists());

        let store = BlobStore::open(&dir, 1 << 20).unwrap();
        let id = store.put(b"a module image").unwrap();
        store.get(&id).unwrap();
        let s = stats(&dir).unwrap();
        assert_eq!((s.blobs, s.bytes, s.limit, s.hits), (1, 14, 1 << 20, 1));
        let json = to_json(&dir, &s);
        assert_eq!(json["blobs"], 1);
        assert_eq!(json["limit"], 1 << 20);
        let text = table(&dir, &s).to_string();
        assert!(text.contains("14 B") && text.contains("1.00 MiB") && text.contains("100.0%"));

        let cleared = clear(&dir).unwrap().unwrap();
        assert_eq!((cleared.blobs, cleared.bytes), (1, 14));
        assert_eq!(stats(&dir).unwrap().blobs, 0);
        assert!(!store.contains(&id));
    }
}
