//! `ferry metadata-server` over real HTTP on loopback: keys that are not UTF-8, the cap on
//! stored bytes, the write token, and Ferry's client sending it.

use std::sync::Arc;

use ferry_core::{Config, MetadataFactory, MetadataStore};
use ferry_metadata_http::server::{Limits, serve, serve_with};
use ferry_metadata_http::store::Store;
use ferry_metadata_http::token::Token;
use ferry_metadata_http::{HttpMetadata, HttpMetadataFactory};

/// A server on a loopback port; it stops when the returned sender drops. Returns its URL.
async fn server(limits: Limits, token: Option<Token>) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_with(listener, Arc::new(Store::in_memory()), limits, token, async move {
        let _ = stopped.await;
    }));
    (format!("http://{addr}/metadata"), stop)
}

#[tokio::test]
async fn keys_that_are_not_utf8_are_refused_not_merged() {
    // The server as every earlier caller starts it.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/metadata", listener.local_addr().unwrap());
    let (_stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(listener, Arc::new(Store::in_memory()), Limits::default(), async move {
        let _ = stopped.await;
    }));
    let c = reqwest::Client::new();
    for raw in ["mooncake/ram/%FF", "mooncake/ram/%FE", "%C3%28", "a%ED%A0%80b"] {
        let r = c.put(format!("{url}?key={raw}")).body(raw).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 400, "PUT {raw}");
        let body = r.text().await.unwrap();
        assert!(body.contains("not valid UTF-8"), "{raw}: {body}");
        let r = c.get(format!("{url}?key={raw}")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 400, "GET {raw}");
    }
    // Nothing was stored under the replacement character either.
    let r = c.get(format!("{url}?key=mooncake/ram/%EF%BF%BD")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    // Valid escapes, `+` for a space and multi-byte characters still work.
    let r = c.put(format!("{url}?key=mooncake/ram/a+b%20%C3%A9")).body("x").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let r = c.get(format!("{url}?key=mooncake/ram/a%20b+é")).send().await.unwrap();
    assert_eq!((r.status().as_u16(), r.text().await.unwrap()), (200, "x".to_owned()));
    let r = c.get(format!("{url}?key=a&key=b")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 400, "two keys");
}

#[tokio::test]
async fn the_total_is_capped_with_507_and_one_large_body_gets_413_and_nothing_is_stored() {
    let limits = Limits { max_total: 1000, max_body: 600, ..Limits::default() };
    let (url, _stop) = server(limits, None).await;
    let c = reqwest::Client::new();
    let put = |key: &str, len: usize| c.put(format!("{url}?key={key}")).body(vec![b'v'; len]).send();
    assert_eq!(put("k1", 400).await.unwrap().status().as_u16(), 200);
    assert_eq!(put("k2", 400).await.unwrap().status().as_u16(), 200);
    let r = put("k3", 400).await.unwrap();
    assert_eq!(r.status().as_u16(), 507);
    let body = r.text().await.unwrap();
    assert!(body.contains("holds 804 bytes") && body.contains("cap of 1000 bytes"), "{body}");
    assert_eq!(c.get(format!("{url}?key=k3")).send().await.unwrap().status().as_u16(), 404);
    let r = put("k4", 601).await.unwrap();
    assert_eq!(r.status().as_u16(), 413);
    let body = r.text().await.unwrap();
    assert!(body.contains("600"), "{body}");
    assert_eq!(c.get(format!("{url}?key=k4")).send().await.unwrap().status().as_u16(), 404);
    // Room is made by deleting, and a value may always shrink.
    assert_eq!(put("k1", 10).await.unwrap().status().as_u16(), 200);
    assert_eq!(put("k3", 400).await.unwrap().status().as_u16(), 200);
    let health = c.get(url.replace("/metadata", "/health")).send().await.unwrap().text().await.unwrap();
    assert!(health.starts_with("OK 3 keys"), "{health}");
}

#[tokio::test]
async fn a_store_past_its_cap_takes_no_growth_but_deletes_and_shrinks() {
    let store = Store::in_memory();
    store.put("a", &[0; 100]).unwrap();
    assert_eq!(store.bytes(), 101);
    assert!(store.put_within("b", &[0; 100], 150).unwrap().is_err());
    assert!(store.put_within("a", &[0; 120], 110).unwrap().is_err(), "grows past the cap");
    assert!(store.put_within("a", &[0; 50], 10).unwrap().is_ok(), "shrinks, though still past the cap");
    assert_eq!(store.bytes(), 51);
    assert!(store.delete("a").unwrap());
    assert_eq!(store.bytes(), 0);
}

#[tokio::test]
async fn writes_need_the_token_reads_do_not_and_ferrys_client_sends_it() {
    let token = Token::new("t0ken-for-writes").unwrap();
    let (url, _stop) = server(Limits::default(), Some(token.clone())).await;
    let c = reqwest::Client::new();
    let key = format!("{url}?key=mooncake/ram/10.0.0.5:17000");
    let r = c.put(&key).body("d").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    assert!(r.text().await.unwrap().contains("Authorization: Bearer"));
    let r = c.put(&key).header("authorization", "Bearer t0ken-for-writes-not").body("d").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = c.put(&key).header("authorization", "Basic dDBrZW4=").body("d").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(c.get(&key).send().await.unwrap().status().as_u16(), 404, "reads are open");

    // Without a token, Ferry's client says what is missing.
    let bare = HttpMetadata::new(&url).unwrap();
    let e = bare.put("mooncake/ram/x", b"d").await.unwrap_err();
    assert!(e.message().contains("HTTP 401") && e.message().contains("FERRY_METADATA_TOKEN"), "{e}");
    let client = HttpMetadata::new(&url).unwrap().with_token(token);
    client.put("mooncake/ram/x", b"d").await.unwrap();
    assert_eq!(bare.get("mooncake/ram/x").await.unwrap().as_deref(), Some(&b"d"[..]));
    client.delete("mooncake/ram/x").await.unwrap();
    assert_eq!(bare.get("mooncake/ram/x").await.unwrap(), None);

    // From the config: the token file named by `metadata_token_file` (relative to the file).
    let dir = std::env::temp_dir().join(format!("ferry-http-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("token"), "t0ken-for-writes\n").unwrap();
    let text = format!(r#"{{"metadata_server": "{url}", "metadata_token_file": "token"}}"#);
    let config = Config::from_json_str(&text, Some(&dir.join("mooncake.json"))).unwrap();
    let store = HttpMetadataFactory.connect(&config.metadata().unwrap(), &config).await.unwrap();
    store.put("mooncake/ram/y", b"e").await.unwrap();
    assert_eq!(bare.get("mooncake/ram/y").await.unwrap().as_deref(), Some(&b"e"[..]));
    // A file that is missing is an error at connect naming the option.
    let text = format!(r#"{{"metadata_server": "{url}", "metadata_token_file": "missing"}}"#);
    let config = Config::from_json_str(&text, Some(&dir.join("mooncake.json"))).unwrap();
    let e = HttpMetadataFactory.connect(&config.metadata().unwrap(), &config).await.err().unwrap();
    assert!(e.message().contains("metadata_token_file") && e.message().contains("missing"), "{e}");
}

#[test]
fn tokens_are_checked_and_never_shown() {
    assert!(Token::new("").is_err());
    assert!(Token::new("two words").is_err());
    assert!(Token::new("line\nbreak").is_err());
    let t = Token::new("abc-DEF_123.~+/=").unwrap();
    assert!(!format!("{t:?}").contains("abc"), "{t:?}");
    assert!(t.matches(b"abc-DEF_123.~+/="));
    assert!(!t.matches(b"abc-DEF_123.~+/"));
    assert!(!t.matches(b"abc-DEF_123.~+/=="));
    assert!(!t.matches(b""));
}

/// A URL missing Mooncake's `/metadata` path is answered 404 by the server; the error names the
/// URL tried and the one to use instead.
#[tokio::test]
async fn a_url_without_the_metadata_path_is_an_error_that_says_so() {
    let (url, _stop) = server(Limits::default(), None).await;
    let root = url.trim_end_matches("/metadata").to_owned();
    let e = HttpMetadata::new(&root).unwrap().put("mooncake/ram/x", b"d").await.unwrap_err();
    let m = e.message();
    assert!(m.contains("HTTP 404") && m.contains(&root) && m.contains(&format!("{root}/metadata")), "{e}");
    // The right URL gets no such hint.
    HttpMetadata::new(&url).unwrap().put("mooncake/ram/x", b"d").await.unwrap();
}
