//! The keyed-DML workload of shared/peers/README.md at SF 0.1 through the engine:
//! count 543,228 and `sum(l_quantity)` 13,875,088, after flush and after reopen.

use arrow::array::{Array, Decimal128Array, RecordBatch};
use gritdb::{Engine, EngineConfig, ScanOptions};
use tpchgen::generators::LineItemGenerator;
use tpchgen_arrow::LineItemArrow;

fn count_and_sum(t: &gritdb::Table) -> (u64, i128) {
    let mut count = 0u64;
    let mut sum = 0i128;
    for b in t.scan(ScanOptions::default().projection(["l_quantity"])).unwrap() {
        let b = b.unwrap();
        let q = b.column(0).as_any().downcast_ref::<Decimal128Array>().unwrap();
        count += b.num_rows() as u64;
        sum += q.iter().map(|v| v.unwrap_or(0)).sum::<i128>();
    }
    (count, sum)
}

#[test]
fn keyed_dml_workload_sf01() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(512 << 20)).unwrap();
    let batches: Vec<RecordBatch> = LineItemArrow::new(LineItemGenerator::new(0.1, 1, 1)).with_batch_size(8192).collect::<Result<_, _>>().unwrap();
    assert_eq!(batches.iter().map(RecordBatch::num_rows).sum::<usize>(), 600_572);
    let t = engine.create_table("lineitem", batches[0].schema(), &["l_orderkey", "l_linenumber"]).unwrap();
    for b in &batches {
        t.insert(b).unwrap();
    }
    for b in batches.iter().step_by(10) {
        t.upsert(b).unwrap();
    }
    for b in batches.iter().skip(5).step_by(10) {
        let keys = b.project(&[0, 3]).unwrap();
        assert_eq!(t.delete(&keys).unwrap(), b.num_rows());
    }
    t.flush().unwrap();
    // l_quantity is Decimal128(15,2): 13,875,088 units = 1,387,508,800 hundredths.
    assert_eq!(count_and_sum(&t), (543_228, 1_387_508_800));
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(512 << 20)).unwrap();
    let t = engine.table("lineitem").unwrap();
    assert_eq!(count_and_sum(&t), (543_228, 1_387_508_800));
    let _ = t.schema().field(4).data_type().is_nested();
}
