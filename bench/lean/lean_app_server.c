/*
 * The lean app-server of the benchmarks, in C: lean_app_server.py's protocol at about
 * a microsecond of CPU per call. Compiled at bench time with the system's cc (see
 * bench/lean/__init__.py); the Python one stands in where there is no compiler.
 *
 * JSON-RPC lines on stdin, answers on stdout, as `codex app-server` does:
 *   initialize        -> {"userAgent","codexHome","platformFamily","platformOs"}
 *   initialized       -> taken (a request before it: -32600 "Not initialized")
 *   bench/ping        -> {"ok":true}
 *   bench/flood       -> 100,000 item/agentMessage/delta notifications, then
 *                        {"flooded":100000}
 *   anything else     -> -32600 "Invalid request: unknown variant `<method>`"
 * A request without "params" gets -32600 "Invalid request: missing field `params`".
 * Notifications and responses from the client are read and dropped; a line that is
 * not a JSON object is skipped. The id comes back byte for byte as it was sent.
 *
 * Each line is scanned at its top level only (keys "id", "method", "params"; other
 * values skipped with strings and nesting respected), which is all it needs. One
 * blocking loop: a large read, every complete line answered, the answers of a read
 * written at once. Exits 0 when stdin closes.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define READ_SIZE (1 << 20)
#define FLOOD 100000

static char *out;
static size_t out_len, out_cap;

static void write_all(const char *data, size_t len) {
    while (len > 0) {
        ssize_t n = write(1, data, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            exit(0); /* the client went away */
        }
        data += n;
        len -= (size_t)n;
    }
}

static void put(const char *data, size_t len) {
    if (out_len + len > out_cap) {
        while (out_len + len > out_cap)
            out_cap = out_cap ? out_cap * 2 : 1 << 16;
        out = realloc(out, out_cap);
        if (!out)
            exit(70);
    }
    memcpy(out + out_len, data, len);
    out_len += len;
}

static void puts_(const char *text) { put(text, strlen(text)); }

static void flush_out(void) {
    write_all(out, out_len);
    out_len = 0;
}

/* The end of the JSON value starting at p (p < end), or NULL if it does not end. */
static const char *skip_value(const char *p, const char *end) {
    int depth = 0;
    if (*p == '"') {
        for (p++; p < end; p++) {
            if (*p == '\\')
                p++;
            else if (*p == '"')
                return p + 1;
        }
        return NULL;
    }
    for (; p < end; p++) {
        char c = *p;
        if (c == '"') {
            const char *q = skip_value(p, end);
            if (!q)
                return NULL;
            p = q - 1;
        } else if (c == '{' || c == '[') {
            depth++;
        } else if (c == '}' || c == ']') {
            if (depth == 0)
                return p;
            if (--depth == 0)
                return p + 1;
        } else if (depth == 0 && (c == ',' || c == ' ' || c == '\t' || c == '\r')) {
            return p;
        }
    }
    return depth == 0 ? p : NULL;
}

static const char *skip_space(const char *p, const char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\r'))
        p++;
    return p;
}

struct span {
    const char *at;
    size_t len;
};

/* Top-level "id", "method" (inside its quotes) and "params" of one line; 0 if not an object. */
static int scan(const char *p, const char *end, struct span *id, struct span *method, int *params) {
    id->at = method->at = NULL;
    *params = 0;
    p = skip_space(p, end);
    if (p >= end || *p != '{')
        return 0;
    p = skip_space(p + 1, end);
    if (p < end && *p == '}')
        return 1;
    while (p < end) {
        const char *key, *key_end, *value, *value_end;
        if (*p != '"')
            return 0;
        key = p + 1;
        key_end = skip_value(p, end);
        if (!key_end)
            return 0;
        p = skip_space(key_end, end);
        if (p >= end || *p != ':')
            return 0;
        value = skip_space(p + 1, end);
        if (value >= end)
            return 0;
        value_end = skip_value(value, end);
        if (!value_end || value_end == value)
            return 0;
        size_t key_len = (size_t)(key_end - 1 - key);
        if (key_len == 2 && memcmp(key, "id", 2) == 0) {
            id->at = value;
            id->len = (size_t)(value_end - value);
        } else if (key_len == 6 && memcmp(key, "method", 6) == 0 && *value == '"') {
            method->at = value + 1;
            method->len = (size_t)(value_end - value - 2);
        } else if (key_len == 6 && memcmp(key, "params", 6) == 0) {
            *params = 1;
        }
        p = skip_space(value_end, end);
        if (p < end && *p == ',') {
            p = skip_space(p + 1, end);
            continue;
        }
        return p < end && *p == '}';
    }
    return 0;
}

static int is(const struct span *s, const char *text) {
    size_t n = strlen(text);
    return s->at && s->len == n && memcmp(s->at, text, n) == 0;
}

static void answer_head(const struct span *id) {
    puts_("{\"id\":");
    put(id->at, id->len);
}

static void error(const struct span *id, const char *message, const struct span *detail,
                  const char *after) {
    answer_head(id);
    puts_(",\"error\":{\"code\":-32600,\"message\":\"");
    puts_(message);
    if (detail) {
        put(detail->at, detail->len);
        puts_(after);
    }
    puts_("\"}}\n");
}

static void flood(void) {
    static const char line[] =
        "{\"method\":\"item/agentMessage/delta\",\"params\":{\"threadId\":\"\",\"turnId\":\"\","
        "\"itemId\":\"msg_lean\",\"delta\":\"x\"}}\n";
    size_t len = sizeof line - 1;
    size_t per_chunk = (1 << 20) / len;
    char *chunk = malloc(per_chunk * len);
    if (!chunk)
        exit(70);
    for (size_t i = 0; i < per_chunk; i++)
        memcpy(chunk + i * len, line, len);
    flush_out();
    for (size_t left = FLOOD; left > 0;) {
        size_t n = left < per_chunk ? left : per_chunk;
        write_all(chunk, n * len);
        left -= n;
    }
    free(chunk);
}

int main(int argc, char **argv) {
    if (argc > 2 || (argc == 2 && strcmp(argv[1], "app-server") != 0)) {
        fprintf(stderr, "lean app-server: the only argument is app-server\n");
        return 2;
    }
    const char *home = getenv("CODEX_HOME");
    char home_buf[4096];
    if (!home || !*home) {
        const char *user = getenv("HOME");
        snprintf(home_buf, sizeof home_buf, "%s/.codex", user ? user : "");
        home = home_buf;
    }
    size_t cap = READ_SIZE * 2, len = 0;
    char *in = malloc(cap);
    int initialized = 0;
    if (!in)
        return 70;
    for (;;) {
        if (cap - len < READ_SIZE) {
            cap *= 2;
            in = realloc(in, cap);
            if (!in)
                return 70;
        }
        ssize_t n = read(0, in + len, READ_SIZE);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return 1;
        }
        if (n == 0)
            return 0;
        len += (size_t)n;
        char *line = in, *end = in + len, *nl;
        while ((nl = memchr(line, '\n', (size_t)(end - line))) != NULL) {
            struct span id, method;
            int params;
            if (scan(line, nl, &id, &method, &params) && id.at && method.at) {
                if (initialized && params && is(&method, "bench/ping")) {
                    answer_head(&id);
                    puts_(",\"result\":{\"ok\":true}}\n");
                } else if (!params) {
                    error(&id, "Invalid request: missing field `params`", NULL, NULL);
                } else if (is(&method, "initialize")) {
                    if (initialized) {
                        error(&id, "Already initialized", NULL, NULL);
                    } else {
                        answer_head(&id);
                        puts_(",\"result\":{\"userAgent\":\"codex_rest_bridge/0.169.0 (Linux; "
                              "lean bench app-server)\",\"codexHome\":\"");
                        puts_(home); /* a path with a quote or backslash would need escaping */
                        puts_("\",\"platformFamily\":\"unix\",\"platformOs\":\"linux\"}}\n");
                    }
                } else if (!initialized) {
                    error(&id, "Not initialized", NULL, NULL);
                } else if (is(&method, "bench/flood")) {
                    flood();
                    answer_head(&id);
                    puts_(",\"result\":{\"flooded\":100000}}\n");
                } else {
                    error(&id, "Invalid request: unknown variant `", &method, "`");
                }
            } else if (method.at && !id.at && is(&method, "initialized")) {
                initialized = 1;
            }
            line = nl + 1;
        }
        if (out_len)
            flush_out();
        len = (size_t)(end - line);
        memmove(in, line, len);
    }
}
