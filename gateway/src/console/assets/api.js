// The HTTP API, as the console calls it: the API key (kept in this tab's sessionStorage,
// never in a URL or in localStorage), JSON requests, and the API's one error shape
// `{code, message}` turned into ApiError.

const KEY_NAME = "switchboard.api_key";

/** The signed-in API key, or null. */
export function apiKey() {
  return sessionStorage.getItem(KEY_NAME);
}

/** Signs in (the key is checked by the caller with a first request). */
export function setApiKey(key) {
  sessionStorage.setItem(KEY_NAME, key);
}

/** Forgets the key. */
export function signOut() {
  sessionStorage.removeItem(KEY_NAME);
}

/** An error of the API (`code`, `message`, HTTP `status`; status 0: the gateway is unreachable). */
export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
  }

  /** Worth retrying the same request later (unreachable, overloaded, rate-limited, 5xx). */
  get retryable() {
    return this.status === 0 || this.status === 429 || this.status >= 500;
  }
}

/** The ApiError of a failed response whose body was `text`. */
export function errorOf(status, text) {
  try {
    const body = JSON.parse(text);
    if (body && typeof body.code === "string") {
      return new ApiError(status, body.code, String(body.message ?? ""));
    }
  } catch {
    // Not the API's shape (a proxy's page, say): fall through.
  }
  return new ApiError(status, `http_${status}`, text.slice(0, 200) || "request failed");
}

/** The Authorization header of the signed-in key. */
export function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

/** Listeners told when the API answers 401 (the key was revoked, say). */
const unauthorizedListeners = new Set();
export function onUnauthorized(listener) {
  unauthorizedListeners.add(listener);
}

/**
 * `method path` with an optional JSON body; resolves to the JSON answer (null when empty),
 * rejects with ApiError. `signal` aborts (an AbortError, not an ApiError).
 */
export async function request(method, path, body, { signal, headers = {} } = {}) {
  const init = {
    method,
    signal,
    cache: "no-store",
    headers: { Accept: "application/json", ...authHeaders(), ...headers },
  };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ApiError(0, "unreachable", `cannot reach the gateway: ${error.message}`);
  }
  const text = await response.text();
  if (!response.ok) {
    const error = errorOf(response.status, text);
    if (response.status === 401) unauthorizedListeners.forEach((listener) => listener(error));
    throw error;
  }
  return text ? JSON.parse(text) : null;
}

export const api = {
  get: (path, options) => request("GET", path, undefined, options),
  post: (path, body, options) => request("POST", path, body ?? {}, options),
  patch: (path, body, options) => request("PATCH", path, body, options),
  delete: (path, options) => request("DELETE", path, undefined, options),
};

/** `path?k=v…` without the empty values. */
export function withQuery(path, params) {
  const query = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value !== undefined && value !== null && value !== "") query.set(name, String(value));
  }
  const text = query.toString();
  return text ? `${path}?${text}` : path;
}

/** A fresh idempotency key (the API accepts `[A-Za-z0-9-_.:]`, 1–128 characters). */
export function idempotencyKey() {
  // getRandomValues, not randomUUID: the latter exists only on https and localhost pages.
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return `console-${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}
