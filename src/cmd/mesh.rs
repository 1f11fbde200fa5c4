//! `gleam mesh`: create, join and show the mesh this device belongs to.

use std::process::ExitCode;

use anyhow::{Context, bail};
use gleam_auth::identity::{Identity, IdentityError, MeshSecret, MeshSecretError};

/// `gleam mesh [--config-dir DIR] COMMAND`.
pub type Args = super::WithConfigDir<Command>;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Create a new mesh secret on this device and print the join code for the others.
    Init {
        /// Replace an existing secret (devices using the old one are locked out).
        #[arg(long)]
        force: bool,
    },
    /// Join the mesh whose join code `gleam mesh init` printed.
    Join {
        /// The join code (`gleam-…`).
        code: String,
        /// Replace an existing secret.
        #[arg(long)]
        force: bool,
    },
    /// Show this device's peer id and its mesh.
    Show {
        /// Also print the join code (a secret: anyone holding it can join).
        #[arg(long)]
        code: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = args.config.path()?;
    match args.command {
        Command::Init { force } => {
            refuse_overwrite(&dir, force)?;
            let secret = MeshSecret::generate();
            secret.store(&dir)?;
            let id = Identity::load_or_create(&dir)?;
            println!("Created a new mesh (fingerprint {}).", secret.fingerprint());
            println!("This device is {}.", id.peer_id());
            println!(
                "On every other device, run:\n\n    gleam mesh join {}\n",
                secret.join_code()
            );
        }
        Command::Join { code, force } => {
            let secret = MeshSecret::from_join_code(&code)?;
            if !force
                && let Ok(existing) = MeshSecret::load(&dir)
                && existing == secret
            {
                println!(
                    "Already in this mesh (fingerprint {}).",
                    secret.fingerprint()
                );
                return Ok(ExitCode::SUCCESS);
            }
            refuse_overwrite(&dir, force)?;
            secret.store(&dir)?;
            let id = Identity::load_or_create(&dir)?;
            println!("Joined mesh {} as {}.", secret.fingerprint(), id.peer_id());
        }
        Command::Show { code, json } => {
            // Only looks: no identity is made here (that is `mesh init`/`join` or `gleam peer`).
            let id = match Identity::load(&dir) {
                Ok(id) => Some(id.peer_id()),
                Err(IdentityError::Missing { .. }) => None,
                Err(err) => return Err(err.into()),
            };
            let secret = match MeshSecret::load(&dir) {
                Ok(secret) => Some(secret),
                Err(MeshSecretError::Missing { .. }) => None,
                Err(err) => return Err(err.into()),
            };
            if json {
                let value = serde_json::json!({
                    "peer_id": id,
                    "config_dir": dir,
                    "mesh_fingerprint": secret.as_ref().map(MeshSecret::fingerprint),
                    "join_code": secret.as_ref().filter(|_| code).map(MeshSecret::join_code),
                });
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                match id {
                    Some(id) => println!("peer id:    {id}"),
                    None => println!(
                        "peer id:    none yet (made by `gleam mesh init`, `gleam mesh join` or `gleam peer`)"
                    ),
                }
                println!("config dir: {}", dir.display());
                match &secret {
                    Some(secret) => println!("mesh:       {}", secret.fingerprint()),
                    None => println!(
                        "mesh:       none (run `gleam mesh init` or `gleam mesh join CODE`)"
                    ),
                }
                if let (true, Some(secret)) = (code, &secret) {
                    println!("join code:  {}", secret.join_code());
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn refuse_overwrite(dir: &std::path::Path, force: bool) -> anyhow::Result<()> {
    match MeshSecret::load(dir) {
        Err(MeshSecretError::Missing { .. }) => Ok(()),
        _ if force => Ok(()),
        Ok(existing) => bail!(
            "this device is already in mesh {}; pass --force to replace it",
            existing.fingerprint()
        ),
        Err(err) => {
            Err(err).context("an unreadable mesh secret exists; pass --force to replace it")
        }
    }
}
