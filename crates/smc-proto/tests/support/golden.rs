//! The reviewed-table check shared by the (state, event) table tests of
//! smc-proto and smc-engine (the engine's tests include this file by path).

/// Compares `got` with the golden file `tests/golden/<file>` of the crate
/// being tested; with `UPDATE_GOLDEN` set, writes `got` there first. `what`
/// names the table in the failure message.
pub fn check(manifest_dir: &str, file: &str, got: &str, what: &str) {
    let path = format!("{manifest_dir}/tests/golden/{file}");
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, got).unwrap();
    }
    let want =
        std::fs::read_to_string(&path).expect("golden table missing; run with UPDATE_GOLDEN=1");
    assert!(
        got == want,
        "{what} table changed; rerun with UPDATE_GOLDEN=1 and review the diff"
    );
}
