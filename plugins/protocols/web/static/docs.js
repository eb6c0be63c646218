// Starts Swagger UI or ReDoc on the server's OpenAPI document. With --api-key the document and
// "Try it out" need a key: the one saved by the playground (same origin) is sent as a Bearer token.
(function () {
  "use strict";
  var specUrl = document.querySelector('meta[name="llmserve-openapi"]').content;
  var key = "";
  try { key = window.localStorage.getItem("llmserve.apiKey") || ""; } catch (e) { key = ""; }

  if (window.SwaggerUIBundle) {
    window.ui = window.SwaggerUIBundle({
      url: specUrl,
      dom_id: "#swagger-ui",
      deepLinking: true,
      layout: "BaseLayout",
      presets: [window.SwaggerUIBundle.presets.apis, window.SwaggerUIBundle.SwaggerUIStandalonePreset],
      requestInterceptor: function (request) {
        if (key && !request.headers.Authorization) { request.headers.Authorization = "Bearer " + key; }
        return request;
      }
    });
  } else if (window.Redoc) {
    var headers = key ? { Authorization: "Bearer " + key } : {};
    fetch(specUrl, { headers: headers })
      .then(function (r) { if (!r.ok) { throw new Error(specUrl + ": HTTP " + r.status); } return r.json(); })
      .then(function (spec) { window.Redoc.init(spec, { hideDownloadButton: false }, document.getElementById("redoc")); })
      .catch(function (err) { document.getElementById("redoc").textContent = "Could not load the API document: " + err.message; });
  }
})();
