//! Compaction: rewrites data files with many deleted rows and merges small files, so the file
//! count and the key index stay bounded under delete/reinsert churn.
//!
//! Protocol (the caller holds the table's flush lock throughout, so no flush commits in
//! between; the table state lock only for the in-memory steps):
//! 1. [`TableStore::plan_compaction`] (state lock): pick inputs, snapshot their deletion
//!    vectors, reserve a new file id. Only when no flush is staged, so every deletion vector
//!    is committed.
//! 2. [`CompactionPlan::execute`] (no state lock): read the live rows of the inputs, sort them
//!    by key, write the new file (tmp, fsync, rename), build its key-index set (budgeted under
//!    `key_index`).
//! 3. [`TableStore::install_compaction`] (state lock): link the new file's key-index set into
//!    the index (its rows are invisible until step 5: the file is not in the file list yet).
//! 4. [`CompactionPlan::commit`] (no state lock): write the manifest without the inputs and
//!    with the new file.
//! 5. [`TableStore::finish_compaction`] (state lock): swap the file list; the inputs are marked
//!    obsolete and deleted once no scan reads them.
//!
//! A failure before step 4 completes leaves the old files authoritative (the new file is
//! removed or, after a crash, collected at open as a file the manifest does not name).

use crate::error::StorageError;
use crate::index::encode_keys;
use crate::manifest::{FileMeta, Manifest};
use crate::table::{DataFile, FileGuard, TableStore, file_name};
use crate::vfs::Vfs;
use crate::write::{WriteOptions, read_file_reserved, write_data_file, write_data_file_from};
use arrow_array::UInt32Array;
use arrow_schema::SchemaRef;
use gritdb_memctl::{Category, MemoryController, Reservation, TableAccount};
use roaring::RoaringBitmap;
use std::path::PathBuf;
use std::sync::Arc;

/// When files are compacted.
#[derive(Debug, Clone)]
pub struct CompactionOptions {
    /// A file is rewritten once this fraction of its rows is deleted. Default 0.1.
    pub deleted_fraction: f64,
    /// Files with fewer rows than this are "small". Default 131,072.
    pub small_file_rows: u64,
    /// Small files are merged once there are this many. Default 4.
    pub small_files_trigger: usize,
    /// Largest number of live rows one compaction rewrites (bounds its memory). Default 1 Mi;
    /// at most [`crate::MAX_FILE_ROWS`] (a larger value is taken as that).
    pub max_rows: u64,
}

impl Default for CompactionOptions {
    fn default() -> Self {
        Self { deleted_fraction: 0.1, small_file_rows: 128 << 10, small_files_trigger: 4, max_rows: 1 << 20 }
    }
}

/// One planned compaction.
#[derive(Debug)]
pub struct CompactionPlan {
    inputs: Vec<(u32, PathBuf, Arc<RoaringBitmap>, Arc<FileGuard>)>,
    new_id: u32,
    dir: PathBuf,
    schema: SchemaRef,
    key_cols: Vec<usize>,
    vfs: Arc<dyn Vfs>,
    manifest: Manifest,
    /// Builds the new file's key-index set in [`Self::execute`], off the table's lock.
    keys: crate::index::KeyBuilder,
    /// Rows of the inputs not deleted when planned (their deletion vectors are the plan's).
    live_rows: u64,
    /// The new file's key-index set (taken by [`TableStore::install_compaction`];
    /// `Err(detail)` when its keys are not strictly ascending), rows and bytes; no file when
    /// every input row was deleted (the inputs are dropped, nothing is written).
    output: Option<(Option<crate::index::BuildResult>, u64, Option<crate::write::WrittenFile>)>,
    /// The commit renamed its manifest into place (and then failed, or succeeded).
    manifest_renamed: bool,
}

impl CompactionPlan {
    /// Input file ids.
    pub fn inputs(&self) -> Vec<u32> {
        self.inputs.iter().map(|i| i.0).collect()
    }

    /// Reads the inputs' live rows, sorts them by key and writes the new data file.
    /// Decoded rows, and each open reader's page buffers
    /// ([`crate::FileReader::buffer_bytes`]), are reserved under `batch_blocks` while held.
    ///
    /// # Errors
    /// [`StorageError`] ([`StorageError::MissingFile`] for an input that is not on disk); the
    /// new file is not visible then.
    pub fn execute(&mut self, opts: &WriteOptions, ctl: &Arc<MemoryController>, table: Option<&TableAccount>) -> Result<(), StorageError> {
        // An input removed outside the engine is named with its table.
        self.execute_inner(opts, ctl, table).map_err(|e| match &e {
            StorageError::Io { path, .. } => match self.inputs.iter().find(|i| &i.1 == path) {
                Some(input) => e.or_missing_file(&input.1, &self.manifest.table),
                None => e,
            },
            _ => e,
        })
    }

    /// [`Self::execute`] without naming a missing input's table.
    fn execute_inner(&mut self, opts: &WriteOptions, ctl: &Arc<MemoryController>, table: Option<&TableAccount>) -> Result<(), StorageError> {
        // Every input row deleted: the commit drops the inputs and names no new file (an
        // empty file would be read at every open and scan, and counted in `metadata`).
        if self.live_rows == 0 {
            self.output = Some((None, 0, None));
            return Ok(());
        }
        // A corrupt input must not be rewritten into a new file with a valid checksum: every
        // input is checked against its manifest entry, files this process wrote too (a change
        // within the clock tick of their last check is not seen by their stamp, and damage
        // done to one since would become permanent).
        for (_, _, _, guard) in &self.inputs {
            guard.verify_before_rewrite()?;
        }
        if self.inputs.len() == 1 {
            return self.execute_streaming(opts, ctl, table);
        }
        let mut held = Reservation::new(ctl, Category::BatchBlocks, table);
        let mut parts = Vec::new();
        for (_, path, dv, _) in &self.inputs {
            // The reader's metadata and own page and dictionary buffers, while it is open
            // (the metadata reserved before it is parsed).
            let mut open = Reservation::new(ctl, Category::BatchBlocks, table);
            let reader = read_file_reserved(path, None, Arc::clone(dv), 64 << 10, &mut open)?;
            for b in reader {
                let b = b?;
                held.try_grow(b.get_array_memory_size())?;
                parts.push(b);
            }
        }
        // Every copy below is budgeted before it is made (the parts, their concatenation, the
        // key encoding, the sorted copy), and released as soon as it is dropped.
        let parts_bytes = held.size();
        held.try_grow(parts_bytes)?;
        let all = arrow_select::concat::concat_batches(&self.schema, &parts)?;
        drop(parts);
        held.shrink(parts_bytes);
        let conv = crate::index::key_converter(&self.schema, &self.key_cols)?;
        held.try_grow(all.num_rows() * 32)?;
        let keys = encode_keys(&conv, &all, &self.key_cols)?;
        held.try_resize(all.get_array_memory_size() + keys.size())?;
        // Row numbers are `u32`s here (the `take` indices) and in the file's key set.
        crate::index::check_file_rows(all.num_rows())?;
        let mut order: Vec<u32> = (0..all.num_rows() as u32).collect();
        order.sort_unstable_by(|a, b| keys.row(*a as usize).cmp(&keys.row(*b as usize)));
        held.try_grow(all.get_array_memory_size() + keys.size())?;
        let sorted = arrow_select::take::take_record_batch(&all, &UInt32Array::from(order.clone()))?;
        drop(all);
        let mut sorted_keys = conv.empty_rows(order.len(), keys.size());
        for i in &order {
            sorted_keys.push(keys.row(*i as usize));
        }
        drop(keys);
        held.try_resize(sorted.get_array_memory_size() + sorted_keys.size())?;
        let name = file_name(self.new_id);
        let bytes = write_data_file(self.vfs.as_ref(), &self.dir, &name, std::slice::from_ref(&sorted), opts, ctl, table)?;
        let built = self.keys.build(std::slice::from_ref(&sorted_keys))?;
        self.output = Some((Some(built), sorted.num_rows() as u64, Some(bytes)));
        Ok(())
    }

    /// Rewrites one file without its deleted rows, one batch at a time: the file is sorted, and
    /// dropping rows keeps it sorted, so no merge is needed and memory stays at one batch
    /// (reserved under `batch_blocks`), the key encodings and the writer's buffers.
    fn execute_streaming(&mut self, opts: &WriteOptions, ctl: &Arc<MemoryController>, table: Option<&TableAccount>) -> Result<(), StorageError> {
        let (_, path, dv, _) = &self.inputs[0];
        let conv = crate::index::key_converter(&self.schema, &self.key_cols)?;
        let mut keys = conv.empty_rows(0, 0);
        let mut held = Reservation::new(ctl, Category::BatchBlocks, table);
        let mut rows = 0u64;
        let key_cols = self.key_cols.clone();
        // The reader's metadata and own page and dictionary buffers count while it is open
        // (the metadata from before it is parsed).
        let reader = read_file_reserved(path, None, Arc::clone(dv), 8192, &mut held)?;
        let reader_bytes = held.size();
        let stream = reader.map(|b| {
            let b = b?;
            held.try_resize(reader_bytes + b.get_array_memory_size() + keys.size())?;
            for r in &encode_keys(&conv, &b, &key_cols)? {
                keys.push(r);
            }
            rows += b.num_rows() as u64;
            Ok(b)
        });
        let name = file_name(self.new_id);
        let bytes = write_data_file_from(self.vfs.as_ref(), &self.dir, &name, &self.schema, stream, opts, ctl, table)?;
        let built = self.keys.build(std::slice::from_ref(&keys))?;
        drop(held);
        self.output = Some((Some(built), rows, Some(bytes)));
        Ok(())
    }

    /// Writes the manifest that swaps the inputs for the new file.
    ///
    /// # Errors
    /// [`StorageError::Io`]; the old manifest stands then.
    pub fn commit(&mut self) -> Result<(), StorageError> {
        let Some((_, rows, bytes)) = &self.output else { return Ok(()) };
        let inputs: Vec<u32> = self.inputs();
        self.manifest.files.retain(|f| !inputs.contains(&f.id));
        if let Some(bytes) = bytes {
            self.manifest.files.push(output_meta(self.new_id, *rows, bytes));
        }
        self.manifest.files.sort_by_key(|f| f.id);
        self.manifest.write_tracked(self.vfs.as_ref(), &self.dir, &mut self.manifest_renamed)
    }

    /// Removes the new data file after a failed execute or commit — unless the commit renamed
    /// its manifest into place before failing (the directory fsync): that manifest may be the
    /// one on disk and names the file, so it stays. The table's in-memory state goes back to
    /// the inputs, which stay too; the next manifest written no longer names the new file, and
    /// the next open removes it as unnamed.
    pub fn abandon(&self) {
        if self.manifest_renamed {
            tracing::warn!(dir = %self.dir.display(), file = %file_name(self.new_id), "compaction commit failed after its manifest was renamed into place; its file is kept");
            return;
        }
        let _ = self.vfs.remove_file(&self.dir.join(file_name(self.new_id)));
    }
}

/// The manifest entry of a compaction's new file `id`: `rows` rows as `written`, no deletes.
fn output_meta(id: u32, rows: u64, written: &crate::write::WrittenFile) -> FileMeta {
    FileMeta {
        id,
        name: file_name(id),
        rows,
        bytes: written.bytes,
        dv: None,
        deleted: 0,
        crc32: Some(written.crc32),
        dv_crc32: None,
        decoded_bytes: Some(written.decoded_bytes),
    }
}

impl TableStore {
    /// The files found damaged (their bytes did not match their manifest's CRC-32) or missing
    /// (not at their path), which [`Self::plan_compaction`] leaves out. [`FileGuard::verify_if_changed`] on each, off the
    /// table's lock, checks again those changed on disk since (one read of a file restored from a
    /// backup, none while it stays as it was), so a restored file compacts again.
    pub fn damaged_files(&self) -> Vec<Arc<FileGuard>> {
        self.files.values().filter(|f| f.guard.is_damaged()).map(|f| Arc::clone(&f.guard)).collect()
    }

    /// The damage of the first damaged or missing file (by id) as the error a read of it
    /// returns ([`StorageError::CorruptFile`], [`StorageError::MissingFile`]); `None` when no
    /// file is known damaged or missing.
    pub fn damage(&self) -> Option<StorageError> {
        self.files.values().find_map(|f| f.guard.damage()).map(|e| match &e {
            StorageError::Io { path, .. } => {
                let path = path.clone();
                e.or_missing_file(&path, &self.name)
            }
            _ => e,
        })
    }

    /// Picks files to compact: every file with no live row (dropped without a new file), else
    /// the file with the largest deleted fraction above the threshold, else (when there are
    /// enough) the smallest small files, by live rows, up to limit / 10 of their live rows'
    /// decoded bytes; `None` when nothing qualifies or a flush is staged.
    pub fn plan_compaction(&mut self, opts: &CompactionOptions) -> Option<CompactionPlan> {
        if !self.staged.is_empty() {
            return None;
        }
        // The output is one data file: never more rows than a file can hold.
        let max_rows = opts.max_rows.min(crate::MAX_FILE_ROWS as u64);
        let live = |f: &DataFile| f.meta.rows - f.dv_live.len();
        let committed: Vec<&DataFile> = self.files.values().filter(|f| f.pending.is_none()).collect();
        // A file found damaged is left out of every rewrite until it matches its checksum
        // again (restored from a backup: `Self::damaged_files`): before, each compaction
        // picked it again and failed, and the table gained a file a flush (41 files after 40
        // flushes). Files whose rows are all deleted are dropped unread, damaged or not.
        let readable: Vec<&DataFile> = committed.iter().copied().filter(|f| !f.guard.is_damaged()).collect();
        // Files whose every row is deleted (or that have none) go first, all at once: dropping
        // them reads and writes nothing. Before, such a file was rewritten as an empty file,
        // one for one, so under steady upserts of a bounded key set at 8 MiB (2 KB rows, where
        // no two files' rows fit a merge) the files grew by ~120 a second and their metadata
        // without bound (11,000 files and 3.4 MiB after 90 s).
        let dead: Vec<u32> = committed.iter().filter(|f| live(f) == 0).map(|f| f.meta.id).collect();
        let mut inputs: Vec<u32> = Vec::new();
        let worst = readable
            .iter()
            .filter(|f| f.meta.rows > 0 && live(f) <= max_rows && f.dv_live.len() as f64 >= opts.deleted_fraction * f.meta.rows as f64)
            .max_by(|a, b| {
                let fa = a.dv_live.len() as f64 / a.meta.rows as f64;
                let fb = b.dv_live.len() as f64 / b.meta.rows as f64;
                fa.total_cmp(&fb)
            });
        let mut total = 0u64;
        if let Some(w) = worst {
            inputs.push(w.meta.id);
            total += live(w);
        }
        let mut small: Vec<&DataFile> = readable.iter().copied().filter(|f| f.meta.rows < opts.small_file_rows && !inputs.contains(&f.meta.id)).collect();
        if !dead.is_empty() {
            inputs = dead;
        } else if small.len() + usize::from(!inputs.is_empty()) >= opts.small_files_trigger {
            small.sort_by_key(|f| live(f));
            // A merge sorts its inputs in memory (about three copies of the decoded rows):
            // keep the decoded input under limit / 10, so it fits in the flush headroom. By
            // decoded bytes, not file bytes: `LZ4_RAW` stores 1.1 MB rows of repetitive text
            // in 21 KB files, and a merge of three of them at 8 MiB, planned as 64 KB, held
            // the memory an export beside it needed
            // (`breaker_reopen::export_of_wide_rows_at_8_mib_is_exact`). By the live rows'
            // share of them: a merge reads past deleted rows, and files whose rows were mostly
            // upserted again since hold little (see `dead` above: 2 KB rows at 8 MiB, a file a
            // flush threshold of 1 MiB, never merged by their whole bytes).
            let live_bytes = |f: &DataFile| {
                let rows = u128::from(f.meta.rows.max(1));
                u64::try_from(u128::from(f.meta.decoded_estimate()) * u128::from(live(f)) / rows).unwrap_or(u64::MAX)
            };
            let budget = (self.ctl.limit() / 10) as u64;
            let mut bytes = 0u64;
            let single = inputs.len() == 1;
            if single {
                // A rewrite of the worst file streams; merging adds the small files to it.
                inputs.clear();
                total = 0;
            }
            for f in small {
                // Saturating: `decoded_bytes` comes from the manifest, and a hand-edited
                // one near `u64::MAX` wrapped the sum (a panic with overflow checks).
                if total.saturating_add(live(f)) > max_rows || bytes.saturating_add(live_bytes(f)) > budget {
                    break;
                }
                total += live(f);
                bytes += live_bytes(f);
                inputs.push(f.meta.id);
            }
            if inputs.len() < 2 {
                inputs.clear();
                if let Some(w) = worst {
                    inputs.push(w.meta.id);
                }
            }
        }
        // No file id left (see `TableStore::stage_keyed`): no compaction.
        let live_rows: u64 = inputs.iter().filter_map(|id| self.files.get(id)).map(live).sum();
        if inputs.is_empty() || (inputs.len() == 1 && worst.is_none() && live_rows > 0) || self.next_file_id == u32::MAX {
            return None;
        }
        let new_id = self.next_file_id;
        self.next_file_id += 1;
        let files = self.files.values().filter(|f| f.pending.is_none()).map(|f| f.meta.clone()).collect();
        let manifest = Manifest {
            format: crate::manifest::FORMAT,
            table: self.name.clone(),
            version: self.version + 1,
            schema: self.schema.as_ref().clone(),
            primary_key: self.primary_key.clone(),
            next_file_id: self.next_file_id,
            flushed_seq: self.flushed_seq,
            files,
        };
        let inputs = inputs
            .iter()
            .filter_map(|id| {
                let f = self.files.get(id)?;
                Some((*id, self.dir.join(&f.meta.name), Arc::new(f.dv_live.clone()), Arc::clone(&f.guard)))
            })
            .collect();
        Some(CompactionPlan {
            inputs,
            new_id,
            dir: self.dir.clone(),
            schema: Arc::clone(&self.schema),
            key_cols: self.key_cols.clone(),
            vfs: Arc::clone(&self.vfs),
            manifest,
            keys: self.index.builder(),
            live_rows,
            output: None,
            manifest_renamed: false,
        })
    }

    /// Indexes the new file's keys ahead of the manifest commit (its rows stay invisible until
    /// [`Self::finish_compaction`]). The key-index set was built (and budgeted) by
    /// [`CompactionPlan::execute`], off the table's lock; this only links it in.
    ///
    /// # Errors
    /// [`StorageError::CorruptFile`] when the new file's keys are not strictly ascending
    /// (abandon the plan then).
    pub fn install_compaction(&mut self, plan: &mut CompactionPlan) -> Result<(), StorageError> {
        let Some((built, _, _)) = &mut plan.output else { return Ok(()) };
        match built.take() {
            Some(Ok(keys)) => self.index.install(plan.new_id, keys),
            Some(Err(detail)) => return Err(StorageError::CorruptFile { path: plan.dir.join(file_name(plan.new_id)), detail }),
            None => {}
        }
        Ok(())
    }

    /// Forgets the new file's keys after a failed commit.
    pub fn uninstall_compaction(&mut self, plan: &CompactionPlan) {
        self.index.remove_file(plan.new_id);
    }

    /// Swaps the inputs for the new file in memory after the manifest commit. Returns the
    /// rows rewritten.
    #[allow(clippy::needless_pass_by_value)] // the plan is used up: it must not be committed twice
    pub fn finish_compaction(&mut self, plan: CompactionPlan) -> u64 {
        let Some((_, rows, bytes)) = plan.output else { return 0 };
        for (id, _, _, guard) in &plan.inputs {
            guard.mark_obsolete();
            // The input's deletion vector file goes now: the committed manifest no longer
            // names it, and scans still reading the input hold its deleted rows in memory
            // (a crash before this leaves it to the open's sweep of unnamed files). Before,
            // every compacted file that had deletes left its `.dv` file behind until the next
            // open.
            if let Some(dv) = self.files.remove(id).and_then(|f| f.meta.dv) {
                let _ = self.vfs.remove_file(&plan.dir.join(dv));
            }
            self.index.remove_file(*id);
        }
        if let Some(bytes) = bytes {
            let meta = output_meta(plan.new_id, rows, &bytes);
            // Written by this process: its bytes are the ones checksummed.
            let guard = FileGuard::new(plan.dir.join(&meta.name), &self.vfs, None);
            guard.written(bytes.crc32);
            self.files.insert(plan.new_id, DataFile { meta, pending: None, dv_live: RoaringBitmap::new(), dv_committed: RoaringBitmap::new(), guard });
        }
        self.version = plan.manifest.version;
        self.account_metadata();
        rows
    }
}
