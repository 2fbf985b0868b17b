//! What the `ferry` binary refuses, and how: environment variables it reads itself, config
//! values out of range, misspelt config fields (warnings, errors with `--strict`).

use std::process::Output;

mod common;

use common::ferry;

fn tmp(name: &str, text: &str) -> std::path::PathBuf {
    common::tmp_in("checks", name, text)
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn ferry_workers_out_of_range_or_not_a_number_is_a_usage_error_naming_the_variable() {
    for value in ["0", "many", "-1", "1025"] {
        let out = ferry().args(["doctor"]).env("FERRY_WORKERS", value).output().unwrap();
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "FERRY_WORKERS={value}: stdout {stdout}\nstderr {stderr}");
        assert!(
            stderr.contains(&format!("FERRY_WORKERS={value:?}")) && stderr.contains("1 to 1024"),
            "FERRY_WORKERS={value}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let out = ferry().args(["doctor"]).env("FERRY_WORKERS", "1").output().unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let out = ferry().args(["doctor"]).env("FERRY_WORKERS", "").output().unwrap();
    assert!(out.status.success(), "empty counts as unset: {:?}", text(&out));
}

#[test]
fn doctor_refuses_a_transfer_timeout_of_zero_and_says_the_range() {
    let p = tmp("timeout0.json", "{\n  \"protocol\": \"tcp\",\n  \"transfer_timeout_ms\": 0\n}");
    let out = ferry().args(["doctor", "--config"]).arg(&p).output().unwrap();
    let (stdout, _) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout.contains("field `transfer_timeout_ms` at line 3 column 3: is 0; expected 1 to 86400000 milliseconds"),
        "{stdout}"
    );
    let out = ferry().args(["doctor"]).env("FERRY_TRANSFER_TIMEOUT_MS", "0").output().unwrap();
    let (stdout, _) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(stdout.contains("(from environment variable FERRY_TRANSFER_TIMEOUT_MS): is 0; expected 1"), "{stdout}");
    let p = tmp("rank.json", r#"{"protocol": "tcp", "local_rank": 70000}"#);
    let out = ferry().args(["doctor", "--config"]).arg(&p).output().unwrap();
    let (stdout, _) = text(&out);
    assert!(!out.status.success() && stdout.contains("is 70000; expected 0 to 1023"), "{stdout}");
}

#[test]
fn doctor_warns_of_a_misspelt_field_with_the_nearest_known_one_and_strict_refuses_it() {
    let p = tmp(
        "typo.json",
        r#"{"local_hostname": "10.1.2.3:17000", "protocol": "tcp", "metadata_sever": "http://127.0.0.1:1/metadata",
            "tcp_lane": 2}"#,
    );
    let out = ferry().args(["doctor", "--config"]).arg(&p).output().unwrap();
    let (stdout, _) = text(&out);
    assert!(out.status.success(), "a warning alone does not fail: {stdout}");
    assert!(stdout.contains("did you mean `metadata_server`?"), "{stdout}");
    assert!(
        stdout.contains("unknown config field `tcp_lane`") && stdout.contains("did you mean `tcp_lanes`?"),
        "{stdout}"
    );
    assert!(stdout.contains("status:           OK, 2 warning(s)"), "{stdout}");

    let out = ferry().args(["doctor", "--strict", "--config"]).arg(&p).output().unwrap();
    let (stdout, _) = text(&out);
    assert!(!out.status.success(), "--strict makes warnings errors: {stdout}");
    assert!(stdout.contains("2 problem(s)") && stdout.contains("did you mean `metadata_server`?"), "{stdout}");

    // Options declared by the metadata backends built in are known fields.
    tmp("token", "s3cret-token\n");
    let p = tmp(
        "declared.json",
        r#"{"protocol": "tcp", "metadata_server": "P2PHANDSHAKE", "handshake_timeout_ms": 2000,
            "metadata_token_file": "token"}"#,
    );
    let out = ferry().args(["doctor", "--strict", "--config"]).arg(&p).output().unwrap();
    let (stdout, _) = text(&out);
    assert!(out.status.success(), "{stdout}");
    assert!(!stdout.contains("unknown config field"), "{stdout}");
    assert!(stdout.contains("  handshake_timeout_ms = 2000 [file "), "{stdout}");
    assert!(stdout.contains("  metadata_token_file = ") && !stdout.contains("s3cret"), "never the token: {stdout}");
}
