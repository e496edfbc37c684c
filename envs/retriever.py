"""BM25 retriever server speaking Search-R1's protocol (Section 4.1, search QA; docs/design-notes.md#environments).

    POST /retrieve  {"query": "...", "topk": 3, "return_scores": true}
                or  {"queries": ["...", ...], "topk": 3, "return_scores": true}   (Search-R1's batch form)
    -> {"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}   one list per query
       (with "return_scores": false each inner item is the bare document, as Search-R1 answers)
    GET /health -> {"status": "ok", "documents": N}

Any JSONL corpus with `{"id", "contents"}` per line works (Search-R1's wiki-18 dump has this
shape; by its convention the first line of `contents` is the title). The index is bm25s (Lucene
BM25 scoring, English stop words). Standard library HTTP (ThreadingHTTPServer), bound to
127.0.0.1 unless told otherwise:

    python -m envs.retriever --corpus envs/data/search_qa/corpus.jsonl --port 8000
"""
import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import bm25s

MAX_TOPK = 100
MAX_BODY = 1 << 20   # 1 MiB of JSON per request


def load_corpus(path):
    """-> list of {"id", "contents"} dicts; a clear error for a missing file or a bad line."""
    docs = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                    docs.append({"id": str(doc.get("id", len(docs))), "contents": str(doc["contents"])})
                except (json.JSONDecodeError, KeyError, AttributeError) as e:
                    raise ValueError(f"{path}:{n}: expected a JSON object with 'contents' ({e})")
    except FileNotFoundError:
        raise FileNotFoundError(f"retriever corpus not found: {path}")
    if not docs:
        raise ValueError(f"retriever corpus {path} has no documents")
    return docs


class BM25Index:
    """bm25s over a list of documents; `search(queries, topk)` -> [[(doc, score), ...], ...]."""

    def __init__(self, docs):
        t0 = time.perf_counter()
        self.docs = docs
        tokens = bm25s.tokenize([d["contents"] for d in docs], stopwords="en", show_progress=False)
        self.bm25 = bm25s.BM25()
        self.bm25.index(tokens, show_progress=False)
        self.lock = threading.Lock()   # one retrieval at a time: the index is shared by all threads
        self.build_seconds = time.perf_counter() - t0

    def search(self, queries, topk=3):
        k = max(1, min(int(topk), MAX_TOPK, len(self.docs)))
        tokens = bm25s.tokenize(list(queries), stopwords="en", return_ids=False, show_progress=False)
        with self.lock:
            ids, scores = self.bm25.retrieve(tokens, k=k, show_progress=False, n_threads=1)  # [queries, k]
        return [[(self.docs[int(i)], float(s)) for i, s in zip(row_ids, row_scores)]
                for row_ids, row_scores in zip(ids, scores)]


def parse_request(body):
    """-> (queries, topk, return_scores) from a request body; ValueError names what is wrong."""
    try:
        req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"body is not JSON ({e})")
    if not isinstance(req, dict):
        raise ValueError("body must be a JSON object")
    queries = req.get("queries", [req["query"]] if "query" in req else None)
    if not isinstance(queries, list) or not queries or not all(isinstance(q, str) for q in queries):
        raise ValueError("give 'query' (a string) or 'queries' (a non-empty list of strings)")
    topk = req.get("topk", 3)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError("'topk' must be a positive integer")
    return queries, topk, bool(req.get("return_scores", True))


def make_handler(index):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code, payload):
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok", "documents": len(index.docs)})
            else:
                self._send(404, {"error": f"unknown path {self.path}; use POST /retrieve"})

        def do_POST(self):
            if self.path.rstrip("/") != "/retrieve":
                return self._send(404, {"error": f"unknown path {self.path}; use POST /retrieve"})
            length = self.headers.get("Content-Length", "")
            if not length.isdigit():
                return self._send(411, {"error": "a JSON body with a Content-Length header is required"})
            if int(length) > MAX_BODY:
                return self._send(413, {"error": f"body over {MAX_BODY} bytes"})
            try:
                queries, topk, with_scores = parse_request(self.rfile.read(int(length)))
            except ValueError as e:
                return self._send(400, {"error": str(e)})
            hits = index.search(queries, topk)
            result = [[{"document": doc, "score": score} if with_scores else doc for doc, score in row]
                      for row in hits]
            self._send(200, {"result": result})

        def log_message(self, fmt, *args):   # quiet: one line per request would flood rollouts
            pass

    return Handler


def serve(corpus, host="127.0.0.1", port=8000):
    """Build the index and return a ThreadingHTTPServer (not yet serving)."""
    index = corpus if isinstance(corpus, BM25Index) else BM25Index(load_corpus(corpus))
    server = ThreadingHTTPServer((host, port), make_handler(index))
    server.daemon_threads = True
    server.index = index
    return server


def start_background(corpus, host="127.0.0.1", port=0):
    """Serve in a daemon thread (port 0 = any free port). -> (server, url); stop with
    server.shutdown(); server.server_close()."""
    server = serve(corpus, host, port)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}/retrieve"


def main():
    ap = argparse.ArgumentParser(description="BM25 retriever server (Search-R1 protocol)")
    ap.add_argument("--corpus", required=True, help="JSONL file with one {'id', 'contents'} per line")
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    try:
        server = serve(args.corpus, args.host, args.port)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise SystemExit(f"retriever: {e}")
    print(f"[retriever] {len(server.index.docs)} documents indexed in {server.index.build_seconds:.2f} s; "
          f"serving POST http://{args.host}:{server.server_address[1]}/retrieve", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
