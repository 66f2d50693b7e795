//! `gritdb-http-service`: gritdb behind HTTP.
//!
//! ```text
//! cargo run --release -p gritdb-http-service --features sql -- --dir ./gritdb-data --addr 127.0.0.1:8080 --memory-limit 256MiB
//! curl localhost:8080/memory
//! ```
//! Ctrl-C or SIGTERM: running requests finish, then the engine is closed (flushed).

use gritdb::{Engine, EngineConfig};

const USAGE: &str = "usage: gritdb-http-service [--dir DIR] [--addr HOST:PORT] [--memory-limit BYTES|NMiB|NGiB] [--sql-timeout SECONDS (default 30; 0: none)]";

/// A `/sql` statement running longer is cancelled (503 `statement_timeout`), so one request
/// cannot hold a blocking thread and its memory without end.
const DEFAULT_SQL_TIMEOUT_S: u64 = 30;

fn parse_bytes(s: &str) -> Option<usize> {
    let (num, mul) = if let Some(n) = s.strip_suffix("GiB") {
        (n, 1usize << 30)
    } else if let Some(n) = s.strip_suffix("MiB") {
        (n, 1 << 20)
    } else if let Some(n) = s.strip_suffix("KiB") {
        (n, 1 << 10)
    } else {
        (s, 1)
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mul)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutdown signal received");
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")))
        .init();
    let mut dir = gritdb::DEFAULT_DATA_DIR.to_owned();
    let mut addr = "127.0.0.1:8080".to_owned();
    let mut config = EngineConfig::default().sql_statement_timeout(std::time::Duration::from_secs(DEFAULT_SQL_TIMEOUT_S));
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value\n{USAGE}"));
        match a.as_str() {
            "--dir" => dir = value()?,
            "--addr" => addr = value()?,
            "--memory-limit" => {
                let v = value()?;
                config = config.memory_limit(parse_bytes(&v).ok_or_else(|| format!("bad --memory-limit {v:?}\n{USAGE}"))?);
            }
            "--sql-timeout" => {
                let v = value()?;
                let secs = v.parse::<u64>().map_err(|_| format!("bad --sql-timeout {v:?}\n{USAGE}"))?;
                config.sql_statement_timeout = (secs > 0).then(|| std::time::Duration::from_secs(secs));
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}").into()),
        }
    }
    let engine = gritdb_http_service::blocking(move || Engine::open(&dir, config).map_err(Into::into)).await?;
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "gritdb HTTP service listening");
    gritdb_http_service::serve(listener, engine, shutdown_signal()).await
}
